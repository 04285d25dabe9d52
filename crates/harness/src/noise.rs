//! A reproducible noisy neighbour (case C19): `N` busy processes outside boxoffice, each
//! spinning one CPU for as long as the [`CpuStealers`] lives, so anyone can repeat a run on
//! a machine where other work takes part of the CPU.

use std::process::{Child, Command, Stdio};

/// `N` busy-looping `sh` processes; dropping the value kills and reaps them.
pub struct CpuStealers {
    children: Vec<Child>,
}

impl CpuStealers {
    /// Starts `n` busy processes (`sh -c 'while :; do :; done'`), none when `n` is 0.
    ///
    /// # Errors
    /// When a process cannot be spawned (the ones already started are stopped).
    pub fn start(n: usize) -> std::io::Result<Self> {
        let mut s = Self { children: Vec::with_capacity(n) };
        for _ in 0..n {
            let child = Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            s.children.push(child);
        }
        Ok(s)
    }

    /// How many are running.
    pub fn len(&self) -> usize {
        self.children.len()
    }

    /// Whether none runs.
    pub fn is_empty(&self) -> bool {
        self.children.is_empty()
    }
}

impl Drop for CpuStealers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn stealers_run_until_dropped() {
        let s = super::CpuStealers::start(2).unwrap();
        assert_eq!(s.len(), 2);
        let pids: Vec<u32> = s.children.iter().map(|c| c.id()).collect();
        for p in &pids {
            assert!(std::path::Path::new(&format!("/proc/{p}")).exists());
        }
        drop(s);
        for p in &pids {
            // Reaped: the pid no longer names our child (it may be reused, never as a zombie of ours).
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            assert!(!stat.contains("(sh) Z"), "{stat}");
        }
    }
}
