// The operator's onsale dashboard: polls GET /admin/onsale once a second with the operator
// token and draws what it answers. No data is embedded in the page; nothing here is trusted
// as markup (every figure is set with textContent).
'use strict';

(function () {
  const KEY = 'boxoffice.admin_token';
  const POLL_MS = 1000;
  const HISTORY = 180; // points kept per sparkline (3 minutes at one per second)
  const $ = (id) => document.getElementById(id);
  const history = { rate: [], ticketed: [], perEvent: new Map() };
  let timer = null;

  function tokenFromFragment() {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (!m) return null;
    // Drop the fragment from the address bar and history: the token stays in this tab only.
    history_replace();
    return decodeURIComponent(m[1]);
  }
  function history_replace() {
    window.history.replaceState(null, '', location.pathname + location.search);
  }
  function token() { return sessionStorage.getItem(KEY); }

  function showLogin(message) {
    $('board').hidden = true;
    $('signout').hidden = true;
    $('login').hidden = false;
    $('login-error').textContent = message || '';
    setStatus('idle', 'not connected');
    $('token').focus();
  }
  function showBoard() {
    $('login').hidden = true;
    $('board').hidden = false;
    $('signout').hidden = false;
  }
  function setStatus(kind, text) {
    const s = $('status');
    s.className = 'status ' + kind;
    s.textContent = text;
  }

  const fmt = {
    n(v, digits) {
      if (v === null || v === undefined || Number.isNaN(v)) return '–';
      if (typeof v !== 'number') return String(v);
      const d = digits === undefined ? (Math.abs(v) >= 100 || Number.isInteger(v) ? 0 : 1) : digits;
      return v.toLocaleString('en-US', { maximumFractionDigits: d, minimumFractionDigits: d });
    },
    ms(v) {
      if (v === null || v === undefined) return '–';
      return v >= 10000 ? fmt.n(v / 1000, 1) + ' s' : fmt.n(v, 0) + ' ms';
    },
    ago(iso, now) {
      if (!iso) return '–';
      const s = Math.max(0, (now - Date.parse(iso)) / 1000);
      if (s < 90) return fmt.n(s, 0) + ' s ago';
      if (s < 5400) return fmt.n(s / 60, 0) + ' min ago';
      return fmt.n(s / 3600, 1) + ' h ago';
    },
  };

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function push(arr, v) {
    arr.push(v === null || v === undefined ? NaN : v);
    if (arr.length > HISTORY) arr.shift();
  }

  function spark(canvas, values, cls) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
    const ctx = canvas.getContext('2d');
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const finite = values.filter(Number.isFinite);
    if (finite.length < 2) return;
    const max = Math.max(...finite, 1e-9), min = Math.min(0, ...finite);
    const x = (i) => (i / (HISTORY - 1)) * w;
    const y = (v) => h - 2 - ((v - min) / (max - min || 1)) * (h - 4);
    const offset = HISTORY - values.length;
    ctx.lineWidth = 1.5;
    ctx.strokeStyle = cls === 'rate' ? '#3b82f6' : '#16a34a';
    ctx.fillStyle = cls === 'rate' ? 'rgba(59,130,246,0.12)' : 'rgba(22,163,74,0.12)';
    ctx.beginPath();
    let started = false, first = 0, last = 0;
    values.forEach((v, i) => {
      if (!Number.isFinite(v)) return;
      const px = x(i + offset), py = y(v);
      if (!started) { ctx.moveTo(px, py); started = true; first = px; } else ctx.lineTo(px, py);
      last = px;
    });
    ctx.stroke();
    ctx.lineTo(last, h); ctx.lineTo(first, h); ctx.closePath(); ctx.fill();
    ctx.fillStyle = '#6b7280';
    ctx.font = '10px system-ui, sans-serif';
    ctx.fillText(fmt.n(max), 2, 10);
  }

  function render(v) {
    const now = Date.now();
    $('cell').textContent = 'cell ' + v.cell;
    $('updated').textContent = 'as of ' + new Date(v.generated_at).toLocaleTimeString();

    // Release controller.
    const r = v.release;
    const rate = $('release-rate');
    if (r) {
      rate.textContent = fmt.n(r.rate_per_s, 1);
      rate.dataset.value = String(r.rate_per_s);
      const action = $('release-action');
      action.textContent = r.stale ? 'stale' : r.action;
      action.className = 'pill ' + (r.stale ? 'bad' : r.action);
      $('release-reason').textContent = r.reasons.length
        ? (r.action === 'decrease' ? 'falling: ' : 'holding: ') + r.reasons.join(', ')
        : (r.action === 'increase' ? 'every signal healthy' : '');
      $('release-moved').textContent = r.moved_at
        ? 'last moved ' + fmt.ago(r.moved_at, now) + ' (' + r.moved_action +
          (r.moved_reasons.length ? ': ' + r.moved_reasons.join(', ') : '') + ')' +
          ' · range ' + fmt.n(r.min_per_s) + '–' + fmt.n(r.max_per_s) + '/s · tick ' + fmt.ago(r.updated_at, now)
        : 'range ' + fmt.n(r.min_per_s) + '–' + fmt.n(r.max_per_s) + '/s';
      push(history.rate, r.rate_per_s);
    } else {
      rate.textContent = '–';
      rate.dataset.value = '';
      $('release-action').textContent = 'off';
      $('release-action').className = 'pill';
      $('release-reason').textContent = 'no release controller has led this cell';
      $('release-moved').textContent = '';
      push(history.rate, null);
    }
    spark($('spark-rate'), history.rate, 'rate');

    // Totals over the events.
    let tickets = 0, ticketed = 0, holds = 0, conflicts = 0, admitted = 0, queued = 0, conflictsKnown = true;
    for (const e of v.events) {
      tickets += e.totals.tickets; ticketed += e.ticketed_per_s; holds += e.holds_per_s;
      if (e.conflicts_per_s === null) conflictsKnown = false; else conflicts += e.conflicts_per_s;
      if (e.queue) { admitted += e.queue.admitted_per_s; queued += e.queue.queued; }
    }
    $('tickets-total').textContent = fmt.n(tickets);
    $('tickets-total').dataset.value = String(tickets);
    $('ticketed-rate').textContent = fmt.n(ticketed, 1);
    $('holds-rate').textContent = fmt.n(holds, 1);
    $('conflicts-rate').textContent = conflictsKnown ? fmt.n(conflicts, 1) : '?';
    $('admitted-rate').textContent = fmt.n(admitted, 1);
    $('queued-total').textContent = fmt.n(queued);
    push(history.ticketed, ticketed);
    spark($('spark-ticketed'), history.ticketed, 'ticketed');

    // Events.
    const body = $('events').tBodies[0];
    body.replaceChildren();
    $('events-empty').hidden = v.events.length > 0;
    const seen = new Set();
    for (const e of v.events) {
      seen.add(e.event_id);
      let h = history.perEvent.get(e.event_id);
      if (!h) { h = []; history.perEvent.set(e.event_id, h); }
      push(h, e.ticketed_per_s);
      const tr = el('tr');
      tr.dataset.event = e.event_id;
      const name = el('td');
      name.append(el('div', e.name, 'name'), el('div', e.event_id + (e.on_sale ? '' : ' · not on sale') +
        (e.cell_state !== 'active' ? ' · ' + e.cell_state : ''), 'dim small'));
      tr.append(name,
        el('td', fmt.n(e.release_per_s, 1), 'num'),
        el('td', e.queue ? fmt.n(e.queue.queued) + (e.queue.pre_queued ? ' (+' + fmt.n(e.queue.pre_queued) + ' pre)' : '') : '–', 'num'),
        el('td', e.queue ? fmt.n(e.queue.admitted_per_s, 1) : '–', 'num'),
        el('td', fmt.n(e.holds_per_s, 1), 'num'),
        el('td', e.conflicts_per_s === null ? '?' : fmt.n(e.conflicts_per_s, 1), 'num' + (e.conflicts_per_s > e.holds_per_s && e.conflicts_per_s > 1 ? ' warn' : '')),
        el('td', fmt.n(e.ticketed_per_s, 1), 'num'),
        el('td', fmt.n(e.totals.seats_held), 'num'),
        el('td', fmt.n(e.totals.tickets) + ' / ' + fmt.n(e.totals.seats), 'num tickets'));
      const sp = el('td');
      const c = el('canvas', null, 'spark small');
      c.width = 120; c.height = 24;
      sp.append(c);
      tr.append(sp);
      body.append(tr);
      spark(c, h, 'ticketed');
    }
    for (const id of history.perEvent.keys()) if (!seen.has(id)) history.perEvent.delete(id);

    // Cell signals.
    const cs = v.cell_signals;
    const dl = $('cell-signals');
    dl.replaceChildren();
    const row = (k, val, bad) => { dl.append(el('dt', k), el('dd', val, bad ? 'bad' : '')); };
    row('oldest unpublished outbox row', fmt.ms(cs.outbox_oldest_age_ms) + ' (' + fmt.n(cs.outbox_unpublished) + ' rows)', cs.outbox_oldest_age_ms > 5000);
    row('parked outbox rows (boxoffice outbox parked)', fmt.n(cs.outbox_parked), cs.outbox_parked > 0);
    row('consumer lag (max)', cs.consumer_lag ? fmt.n(cs.consumer_lag.max) : 'not measured', cs.consumer_lag && cs.consumer_lag.max > 1000);
    row('expired-hold processing delay', fmt.ms(cs.expiry_delay_ms), cs.expiry_delay_ms > 10000);
    row('active holds', fmt.n(cs.active_holds));
    row('DLQ depth', cs.dlq_depth === null ? 'not measured' : fmt.n(cs.dlq_depth) + ' (' + fmt.ago(cs.dlq_checked_at, now) + ')', cs.dlq_depth > 0);
    const lag = $('lag').tBodies[0];
    lag.replaceChildren();
    const parts = cs.consumer_lag ? cs.consumer_lag.by_partition.slice(0, 12) : [];
    for (const p of parts) {
      const tr = el('tr');
      tr.append(el('td', p.group), el('td', String(p.partition), 'num'), el('td', fmt.n(p.lag), 'num'));
      lag.append(tr);
    }
    $('lag-empty').hidden = parts.length > 0;

    // Release signals.
    const sig = $('signals').tBodies[0];
    sig.replaceChildren();
    for (const s of (r ? r.signals : [])) {
      const tr = el('tr', null, 'state-' + s.state);
      tr.append(el('td', s.name), el('td', fmt.n(s.value, 2), 'num'), el('td', fmt.n(s.threshold, 2), 'num'), el('td', s.state));
      sig.append(tr);
    }

    // Last audit.
    const a = v.audit;
    const audit = $('audit').tBodies[0];
    audit.replaceChildren();
    if (a) {
      $('audit-when').textContent = 'finished ' + fmt.ago(a.finished_at, now) + ' (' +
        new Date(a.finished_at).toLocaleString() + ')' + (a.event_id ? ' · event ' + a.event_id : ' · whole ledger') +
        ' · exit ' + a.exit_code + ' · ' + fmt.n(a.total) + ' violation(s)';
      $('audit-when').className = a.total > 0 ? 'bad' : 'dim';
      for (const [name, n] of Object.entries(a.violations)) {
        const tr = el('tr', null, n === null ? 'unchecked' : n > 0 ? 'violation' : '');
        tr.append(el('td', name), el('td', n === null ? 'not checked' : fmt.n(n), 'num'));
        audit.append(tr);
      }
    }
  }

  async function poll() {
    const t = token();
    if (!t) { showLogin(); return; }
    try {
      const res = await fetch('onsale', { headers: { Authorization: 'Bearer ' + t }, cache: 'no-store', credentials: 'omit' });
      if (res.status === 401) {
        sessionStorage.removeItem(KEY);
        stop();
        showLogin('The token was refused.');
        return;
      }
      if (!res.ok) {
        let code = String(res.status);
        try { code += ' ' + (await res.json()).code; } catch (_) { /* not problem+json */ }
        setStatus('bad', 'error ' + code);
      } else {
        render(await res.json());
        showBoard();
        setStatus('live', 'live');
      }
    } catch (e) {
      setStatus('bad', 'unreachable');
    }
    timer = setTimeout(poll, POLL_MS);
  }
  function stop() { if (timer) { clearTimeout(timer); timer = null; } }
  function start() { stop(); poll(); }

  document.addEventListener('DOMContentLoaded', () => {
    const fromLink = tokenFromFragment();
    if (fromLink) sessionStorage.setItem(KEY, fromLink);
    $('login').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const t = $('token').value.trim();
      if (!t) return;
      sessionStorage.setItem(KEY, t);
      $('token').value = '';
      start();
    });
    $('signout').addEventListener('click', () => { sessionStorage.removeItem(KEY); stop(); showLogin(); });
    start();
  });
})();
