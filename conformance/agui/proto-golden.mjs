// Encodes every event of a JSONL file with @ag-ui/proto@1.0.0 and prints one hex line each.
// Regenerates crates/tether-agui/tests/golden/events.proto.hex:
//   node proto-golden.mjs ../../crates/tether-agui/tests/golden/events.jsonl > ../../crates/tether-agui/tests/golden/events.proto.hex
import { readFileSync } from "node:fs";
import { encode } from "@ag-ui/proto";

const warnings = [];
console.warn = (...a) => warnings.push(a.join(" "));
const lines = readFileSync(process.argv[2], "utf8").split("\n").filter((l) => l.trim());
for (const line of lines) {
  process.stdout.write(Buffer.from(encode(JSON.parse(line))).toString("hex") + "\n");
}
if (warnings.length) {
  process.stderr.write(warnings.join("\n") + "\n");
  process.exit(1);
}
