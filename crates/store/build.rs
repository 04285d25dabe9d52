//! Rebuilds the crate when a migration is added, changed or removed: `sqlx::migrate!` reads
//! the migration directories at compile time, and cargo otherwise tracks only the files a
//! macro's output includes, not a new file beside them.
fn main() {
    for dir in ["migrations", "control_migrations", "witness_migrations"] {
        println!("cargo:rerun-if-changed={dir}");
    }
}
