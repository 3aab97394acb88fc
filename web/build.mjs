// Builds the chat page into src/rebar/web/static/ (committed, so a Python-only install needs no
// Node.js), or the unit tests into test-build/.
//
//   node build.mjs              the page, into ../src/rebar/web/static
//   node build.mjs --out DIR    the page, into DIR (the freshness test compares it with the committed build)
//   node build.mjs --tests      test/*.test.ts, into test-build/ for `node --test`
//
// build-info.json records a hash of every input listed in SOURCES; tests/web recomputes it the
// same way to catch a committed build that is older than its sources.

import { createHash } from "node:crypto";
import { mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import * as esbuild from "esbuild";

const WEB_DIR = dirname(fileURLToPath(import.meta.url));
const DEFAULT_OUT = resolve(WEB_DIR, "../src/rebar/web/static");
const SOURCES = ["src", "index.html", "style.css", "build.mjs", "tsconfig.json", "package-lock.json"];
const BANNER = "// Built from web/ by `npm --prefix web run build`; edit the sources there, not this file.";

function filesUnder(path) {
  const absolute = join(WEB_DIR, path);
  try {
    return readdirSync(absolute, { withFileTypes: true }).flatMap((entry) => filesUnder(join(path, entry.name)));
  } catch (error) {
    if (error.code === "ENOTDIR") {
      return [path];
    }
    throw error;
  }
}

function sha256(data) {
  return createHash("sha256").update(data).digest("hex");
}

/** sha256 over "<posix path>\n<sha256 of its bytes>\n" for every source file, in path order. */
function sourceHash() {
  const paths = SOURCES.flatMap(filesUnder).map((path) => path.split("\\").join("/")).sort();
  const hash = createHash("sha256");
  for (const path of paths) {
    hash.update(`${path}\n${sha256(readFileSync(join(WEB_DIR, path)))}\n`);
  }
  return hash.digest("hex");
}

async function buildPage(outDir) {
  mkdirSync(outDir, { recursive: true });
  const result = await esbuild.build({
    absWorkingDir: WEB_DIR,
    entryPoints: ["src/main.ts"],
    bundle: true,
    format: "esm",
    platform: "browser",
    target: ["es2022"],
    charset: "utf8",
    legalComments: "none",
    banner: { js: BANNER },
    write: false,
    outfile: "app.js",
    logLevel: "warning",
  });
  const appJs = result.outputFiles[0].contents;
  const styleCss = readFileSync(join(WEB_DIR, "style.css"));
  // Versioned URLs: a browser never pairs a new page with a cached old script or stylesheet.
  const html = readFileSync(join(WEB_DIR, "index.html"), "utf8")
    .replace('src="/static/app.js"', `src="/static/app.js?v=${sha256(appJs).slice(0, 12)}"`)
    .replace('href="/static/style.css"', `href="/static/style.css?v=${sha256(styleCss).slice(0, 12)}"`);
  writeFileSync(join(outDir, "app.js"), appJs);
  writeFileSync(join(outDir, "style.css"), styleCss);
  writeFileSync(join(outDir, "index.html"), html);
  writeFileSync(join(outDir, "build-info.json"), JSON.stringify({ source_sha256: sourceHash(), sources: SOURCES }, null, 2) + "\n");
  console.log(`built ${relative(process.cwd(), outDir) || "."}: app.js (${appJs.length} bytes), style.css, index.html`);
}

async function buildTests(outDir) {
  rmSync(outDir, { recursive: true, force: true });
  const entryPoints = filesUnder("test").filter((path) => path.endsWith(".test.ts"));
  await esbuild.build({
    absWorkingDir: WEB_DIR,
    entryPoints,
    bundle: true,
    format: "esm",
    platform: "node",
    target: ["node20"],
    outdir: outDir,
    outExtension: { ".js": ".mjs" },
    logLevel: "warning",
  });
}

const { values } = parseArgs({ options: { out: { type: "string" }, tests: { type: "boolean", default: false } } });
if (values.tests) {
  await buildTests(join(WEB_DIR, "test-build"));
} else {
  await buildPage(values.out ? resolve(values.out) : DEFAULT_OUT);
}
