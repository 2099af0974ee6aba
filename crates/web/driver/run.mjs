// Drives the Lazuli page (target/web, built by scripts/web) in headless
// Chromium with WebGPU on SwiftShader: the in-page differential checks,
// the digits demo (>= 95% test accuracy), the fused-kernel panel, then a
// screenshot at target/web/demo.png; a second page without WebGPU must
// show its error on the page and still train on the CPU backend.
// Usage: node run.mjs <target/web> [epochs]. Exit status 1 on any failure.
import { chromium } from "playwright-core";
import http from "node:http";
import fs from "node:fs";
import path from "node:path";
import os from "node:os";

const root = path.resolve(process.argv[2] || "target/web");
const epochs = Number(process.argv[3] || 50);
const types = { ".html": "text/html", ".js": "text/javascript", ".wasm": "application/wasm", ".png": "image/png" };
const server = http
  .createServer((req, res) => {
    const file = path.join(root, decodeURIComponent(new URL(req.url, "http://x").pathname));
    const target = file.endsWith("/") ? path.join(file, "index.html") : file;
    if (!target.startsWith(root) || !fs.existsSync(target)) {
      res.statusCode = 404;
      return res.end("not found");
    }
    res.setHeader("content-type", types[path.extname(target)] || "application/octet-stream");
    fs.createReadStream(target).pipe(res);
  })
  .listen(0, "127.0.0.1");
await new Promise((r) => server.once("listening", r));
const base = `http://localhost:${server.address().port}/`;

// WebGPU on SwiftShader (software Vulkan inside Chromium), headless.
const common = [
  "--headless=new", "--no-sandbox", "--disable-gpu-sandbox", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync",
];
const webgpu = ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--enable-features=Vulkan"];
const failures = [];
const check = (ok, what) => {
  console.log(`${ok ? "ok  " : "FAIL"} ${what}`);
  if (!ok) failures.push(what);
};

async function open(flags, url, timeoutMs) {
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), "lazuli-chromium-"));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: [...common, ...flags],
    viewport: { width: 1024, height: 1400 },
  });
  const page = context.pages()[0] || (await context.newPage());
  const logs = [];
  page.on("console", (m) => logs.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => logs.push(`pageerror: ${e}`));
  await page.goto(url);
  try {
    await page.waitForFunction(() => window.lazuli && window.lazuli.done, null, { timeout: timeoutMs, polling: 500 });
  } catch (e) {
    logs.push(`timeout: ${e.message}`);
  }
  const state = await page.evaluate(() => ({
    lazuli: window.lazuli,
    errors: document.getElementById("errors").textContent,
  }));
  return { context, page, logs, state, userDataDir };
}

const started = Date.now();
const gpu = await open(webgpu, `${base}?checks&epochs=${epochs}`, 240000);
const s = gpu.state.lazuli || {};
console.log(JSON.stringify({ checks: s.checks, demo: s.demo, fused: s.fused, error: s.error }, null, 1));
check(!s.error && gpu.state.errors === "", `no error on the page (${s.error || gpu.state.errors || "none"})`);
check(s.demo && /WebGpu|BrowserWebGpu/i.test(s.demo.device), `the demo ran on WebGPU (${s.demo && s.demo.device})`);
for (const c of (s.checks && s.checks.cases) || []) check(c.ok, `check ${c.name} (max error ${c.max_error}) ${c.detail}`);
check(s.checks && s.checks.cases.length === 8, "all eight checks ran (five differential, three of errors)");
check(s.demo && s.demo.test_accuracy >= 0.95, `test accuracy ${s.demo && s.demo.test_accuracy} >= 0.95`);
check(s.fused && s.fused.kernels >= 1 && s.fused.wgsl_bytes > 100, "the fused panel shows generated WGSL");
fs.mkdirSync(root, { recursive: true });
await gpu.page.screenshot({ path: path.join(root, "demo.png"), fullPage: true });
console.log(`screenshot: ${path.join(root, "demo.png")}`);
if (failures.length) console.log(gpu.logs.join("\n"));
await gpu.context.close();

// Without WebGPU the page says so and trains on the CPU backend.
const cpu = await open(["--disable-features=WebGPU", "--disable-gpu"], `${base}?epochs=1`, 120000);
const c = cpu.state.lazuli || {};
check(/no WebGPU device/.test(cpu.state.errors), `no adapter is shown on the page (${cpu.state.errors.trim()})`);
check(c.demo && c.demo.device === "cpu" && c.done, "and the demo still ran, on the CPU backend");
if (failures.length) console.log(cpu.logs.join("\n"));
await cpu.context.close();
server.close();
console.log(`browser suite: ${failures.length ? "FAILED" : "passed"} in ${((Date.now() - started) / 1000).toFixed(1)} s`);
process.exit(failures.length ? 1 : 0);
