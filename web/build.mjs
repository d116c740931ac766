// Builds the UI into crates/tether-serve/assets/ (committed: the Rust build needs no node).
// Deterministic: pinned esbuild, no timestamps, no source maps.
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";

const out = new URL("../crates/tether-serve/assets/", import.meta.url).pathname;
mkdirSync(out, { recursive: true });
await build({
  entryPoints: ["src/app.js"],
  bundle: true,
  minify: true,
  format: "esm",
  target: "es2022",
  platform: "browser",
  legalComments: "none",
  charset: "utf8",
  outfile: `${out}app.js`,
  logLevel: "warning",
});
copyFileSync("src/index.html", `${out}index.html`);
copyFileSync("src/app.css", `${out}app.css`);
console.log(`built ${out}`);
