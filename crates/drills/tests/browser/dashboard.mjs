// Opens the operator dashboard in headless Chromium (Playwright, pinned in package.json) and
// waits for a live onsale to show on it: an R value, a ticket count above 0, then a higher
// one. Writes a screenshot. Driven by crates/drills/tests/it/dashboard.rs.
//
// Environment: DASHBOARD_URL (with #token=…), SCREENSHOT (path), BOXOFFICE_CHROMIUM
// (executable), BOXOFFICE_PLAYWRIGHT_DIR (where `npm ci` installed playwright-core),
// USER_DATA_DIR (a fresh profile), WAIT_MS (each wait's bound).
// Prints one JSON line per milestone on stdout: {"ready": …}, {"first": …}, {"done": …}.
import { mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

const need = (k) => {
  const v = process.env[k];
  if (!v) { console.error(`${k} is required`); process.exit(2); }
  return v;
};
const url = need('DASHBOARD_URL');
const screenshot = need('SCREENSHOT');
const executablePath = need('BOXOFFICE_CHROMIUM');
const pwDir = need('BOXOFFICE_PLAYWRIGHT_DIR');
const userDataDir = need('USER_DATA_DIR');
const timeout = Number(process.env.WAIT_MS || 90000);

const { chromium } = await import(pathToFileURL(join(pwDir, 'node_modules', 'playwright-core', 'index.mjs')).href);
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath,
  headless: true,
  viewport: { width: 1400, height: 1000 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const say = (o) => console.log(JSON.stringify(o));
let failed = false;
try {
  const page = context.pages()[0] || await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  await page.goto(url, { waitUntil: 'domcontentloaded', timeout });
  // Connected: the board is shown and R is there (the controller ticks before any buyer).
  await page.waitForFunction(() => !document.getElementById('board').hidden &&
    document.getElementById('release-rate').dataset.value !== '', null, { timeout, polling: 200 });
  const tickets = () => page.$eval('#tickets-total', (e) => Number(e.dataset.value || 0));
  const rate = () => page.$eval('#release-rate', (e) => Number(e.dataset.value));
  say({ ready: { rate: await rate(), tickets: await tickets(), fragment_left: await page.evaluate(() => location.hash) } });
  await page.waitForFunction(() => Number(document.getElementById('tickets-total').dataset.value || 0) > 0,
    null, { timeout, polling: 200 });
  const first = await tickets();
  say({ first: { tickets: first, rate: await rate() } });
  await page.waitForFunction((n) => Number(document.getElementById('tickets-total').dataset.value || 0) > n,
    first, { timeout, polling: 200 });
  const later = await tickets();
  mkdirSync(dirname(screenshot), { recursive: true });
  await page.screenshot({ path: screenshot, fullPage: true });
  say({ done: { first, later, rate: await rate(), errors, screenshot } });
} catch (e) {
  failed = true;
  console.error(String(e && e.stack || e));
  try {
    const page = context.pages()[0];
    if (page) { mkdirSync(dirname(screenshot), { recursive: true }); await page.screenshot({ path: screenshot, fullPage: true }); }
  } catch (_) { /* the failure above is the one to report */ }
} finally {
  await context.close();
}
process.exit(failed ? 1 : 0);
