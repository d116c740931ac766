// An MCP elicitation (a tool's server asking the user for input mid-call) as tether serve sends
// it: an AG-UI interrupt with `reason: "elicitation"`, the server's `message`, and in `metadata`
// the mode (`form` with a `requestedSchema`, or `url`). This module turns that interrupt into a
// list of form fields and the user's input back into the answer; it touches no DOM, so its rules
// can be checked outside a browser.
//
// Everything here comes from an MCP server: hostile until checked. MCP restricts a form to a flat
// object of primitive fields (string with optional format, enum or length bounds; number/integer
// with bounds; boolean; single- and multi-select enums). Anything else is reported as unsupported
// and the form can then only be declined or cancelled. Counts and lengths are bounded, and every
// text meant for display goes through `visible` (control and bidi characters shown escaped).

/** Bounds on what a server's request may make the UI show or send. */
export const LIMITS = Object.freeze({
  fields: 32, // fields in one form
  options: 100, // choices in one enum
  name: 100, // characters of a field's name
  label: 200, // characters of a title or choice label
  description: 1000, // characters of a field's description
  message: 4000, // characters of the server's message
  url: 2000, // characters of a URL to visit
  string: 10000, // characters the user may type in one field
  content: 64 * 1024, // bytes of the accepted content's JSON (tether-serve's own limit)
});

const FORMATS = new Set(["email", "uri", "date", "date-time"]);

// C0/C1 controls (except newline and tab), and the characters that reorder or hide text.
const HIDDEN = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]/gu;

/**
 * A server-supplied value as display text: a string (anything else is JSON), at most `max`
 * characters (then "…"), with control and bidi characters shown as `\u{…}` escapes.
 */
export function visible(value, max) {
  let s = typeof value === "string" ? value : value === undefined || value === null ? "" : JSON.stringify(value);
  const chars = Array.from(s);
  if (chars.length > max) s = chars.slice(0, max).join("") + "…";
  return s.replace(HIDDEN, (c) => `\\u{${c.codePointAt(0).toString(16)}}`);
}

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);
const nonNegInt = (v) => (Number.isSafeInteger(v) && v >= 0 ? v : undefined);
const finite = (v) => (typeof v === "number" && Number.isFinite(v) ? v : undefined);
const textOr = (v, fallback, max) => (typeof v === "string" && v !== "" ? visible(v, max) : fallback);

/** The choices of an enum (`enum` + optional `enumNames`, or `oneOf`/`anyOf` of `{const, title}`). */
function choices(schema) {
  if (Array.isArray(schema.enum)) {
    if (!schema.enum.every((v) => typeof v === "string")) return { error: "an enum whose values are not all strings" };
    const names = Array.isArray(schema.enumNames) && schema.enumNames.length === schema.enum.length ? schema.enumNames : null;
    return { options: schema.enum.map((v, i) => ({ value: v, label: textOr(names?.[i], visible(v, LIMITS.label), LIMITS.label) })) };
  }
  const list = Array.isArray(schema.oneOf) ? schema.oneOf : Array.isArray(schema.anyOf) ? schema.anyOf : null;
  if (!list) return null;
  if (!list.every((o) => isObject(o) && typeof o.const === "string")) return { error: "choices that are not all {const: string}" };
  return { options: list.map((o) => ({ value: o.const, label: textOr(o.title, visible(o.const, LIMITS.label), LIMITS.label) })) };
}

/** One property of the requested schema as a field (`unsupported` says why it cannot be filled). */
function field(name, schema, required) {
  const f = {
    name,
    label: visible(name, LIMITS.name),
    description: "",
    required,
    kind: "unsupported",
  };
  if (Array.from(name).length > LIMITS.name) return { ...f, unsupported: `a field name longer than ${LIMITS.name} characters` };
  if (!isObject(schema)) return { ...f, unsupported: "a field without a schema" };
  f.label = textOr(schema.title, f.label, LIMITS.label);
  f.description = textOr(schema.description, "", LIMITS.description);
  const type = schema.type;
  if (type === "string") {
    const c = choices(schema);
    if (c?.error) return { ...f, unsupported: c.error };
    if (c) {
      if (c.options.length > LIMITS.options) return { ...f, unsupported: `more than ${LIMITS.options} choices` };
      f.kind = "select";
      f.options = c.options;
      if (c.options.some((o) => o.value === schema.default)) f.default = schema.default;
      return f;
    }
    f.kind = "string";
    f.format = FORMATS.has(schema.format) ? schema.format : undefined;
    f.minLength = nonNegInt(schema.minLength);
    f.maxLength = Math.min(nonNegInt(schema.maxLength) ?? LIMITS.string, LIMITS.string);
    if (typeof schema.default === "string" && Array.from(schema.default).length <= f.maxLength) f.default = schema.default;
    return f;
  }
  if (type === "number" || type === "integer") {
    f.kind = type;
    f.minimum = finite(schema.minimum);
    f.maximum = finite(schema.maximum);
    const d = finite(schema.default);
    if (d !== undefined && (type === "number" || Number.isInteger(d))) f.default = d;
    return f;
  }
  if (type === "boolean") {
    f.kind = "boolean";
    f.default = schema.default === true;
    return f;
  }
  if (type === "array" && isObject(schema.items)) {
    const c = choices(schema.items);
    if (!c) return { ...f, unsupported: "a list that is not a choice among fixed values" };
    if (c.error) return { ...f, unsupported: c.error };
    if (c.options.length > LIMITS.options) return { ...f, unsupported: `more than ${LIMITS.options} choices` };
    f.kind = "multiselect";
    f.options = c.options;
    f.minItems = nonNegInt(schema.minItems);
    f.maxItems = nonNegInt(schema.maxItems);
    if (Array.isArray(schema.default)) f.default = schema.default.filter((v) => c.options.some((o) => o.value === v));
    return f;
  }
  return { ...f, unsupported: `field type ${visible(JSON.stringify(type ?? null), 40)}` };
}

/**
 * Reads an elicitation interrupt: `{message, mode: "form" | "url" | "unsupported", url?, fields,
 * problems}`. Any problem (or an unsupported field) means the request can only be declined or
 * cancelled; each problem is a sentence for the user.
 */
export function parseElicitation(interrupt) {
  const meta = isObject(interrupt?.metadata) ? interrupt.metadata : {};
  const out = {
    message: visible(interrupt?.message ?? "", LIMITS.message),
    mode: "unsupported",
    fields: [],
    problems: [],
  };
  const mode = meta.mode ?? (meta.requestedSchema !== undefined ? "form" : undefined);
  if (mode === "url") {
    if (typeof meta.url !== "string" || meta.url === "") {
      out.problems.push("The server asked you to open a URL but gave none.");
      return out;
    }
    out.mode = "url";
    out.url = visible(meta.url, LIMITS.url);
    // Only a plain web address can be opened from here.
    try {
      const u = new URL(meta.url);
      if ((u.protocol === "https:" || u.protocol === "http:") && meta.url.length <= LIMITS.url && out.url === meta.url) out.href = u.href;
    } catch {
      // not a URL: shown as text only
    }
    return out;
  }
  if (mode !== "form") {
    out.problems.push(`Unsupported kind of request (${visible(JSON.stringify(mode ?? null), 40)}): it can only be declined or cancelled.`);
    return out;
  }
  const schema = meta.requestedSchema;
  if (!isObject(schema) || (schema.type !== undefined && schema.type !== "object")) {
    out.problems.push("The server's form is not an object of fields: it can only be declined or cancelled.");
    return out;
  }
  out.mode = "form";
  const props = schema.properties === undefined ? {} : schema.properties;
  if (!isObject(props)) {
    out.problems.push("The server's form lists its fields wrongly: it can only be declined or cancelled.");
    return out;
  }
  const required = Array.isArray(schema.required) ? schema.required.filter((r) => typeof r === "string") : [];
  const names = Object.keys(props);
  if (names.length > LIMITS.fields) {
    out.problems.push(`The server asks for ${names.length} fields (at most ${LIMITS.fields} are supported): it can only be declined or cancelled.`);
  }
  for (const r of required) {
    if (!Object.hasOwn(props, r)) out.problems.push(`The server requires a field it does not describe (${visible(r, LIMITS.name)}).`);
  }
  for (const name of names.slice(0, LIMITS.fields)) {
    const f = field(name, props[name], required.includes(name));
    if (f.unsupported) out.problems.push(`${f.label}: unsupported (${f.unsupported}).`);
    out.fields.push(f);
  }
  return out;
}

const EMAIL = /^[^\s@]+@[^\s@]+$/u;
const DATE = /^(\d{4})-(\d{2})-(\d{2})$/u;
const DATE_TIME = /^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([Zz]|[+-]\d{2}:\d{2})$/u;

function validDate(s) {
  const m = DATE.exec(s);
  if (!m) return false;
  const d = new Date(Date.UTC(+m[1], +m[2] - 1, +m[3]));
  return d.getUTCFullYear() === +m[1] && d.getUTCMonth() === +m[2] - 1 && d.getUTCDate() === +m[3];
}

function formatError(format, s) {
  if (format === "email" && !EMAIL.test(s)) return "an email address, like name@example.com";
  if (format === "uri") {
    try {
      const u = new URL(s);
      if (!/^[a-z][a-z0-9+.-]*:$/u.test(u.protocol)) return "a full address, like https://example.com";
    } catch {
      return "a full address, like https://example.com";
    }
  }
  if (format === "date" && !validDate(s)) return "a date, like 2026-12-01";
  if (format === "date-time" && !(DATE_TIME.test(s) && validDate(s.slice(0, 10)) && !Number.isNaN(Date.parse(s)))) {
    return "a date and time with its zone, like 2026-12-01T09:30:00Z";
  }
  return null;
}

/**
 * The content of an accepted form from the user's input (`values`: name → the input's value: a
 * string for text, number and select fields, a boolean for a checkbox, an array for a
 * multi-select). Returns `{content, errors}`: `errors` maps a field name to what is wrong, and
 * `content` is null while any is (or the form has problems). Optional fields left empty are
 * left out. A checkbox the user never touched reads as `undefined`: an optional boolean is then
 * left out (the server applies its own default; an untouched box is not the user saying "no"),
 * a required one is sent as shown (its default, else false); one the user set is sent as set.
 */
export function collect(parsed, values) {
  const errors = new Map();
  const entries = [];
  if (parsed.mode !== "form" || parsed.problems.length) return { content: null, errors, blocked: true };
  for (const f of parsed.fields) {
    const raw = values.get(f.name);
    const fail = (msg) => errors.set(f.name, msg);
    if (f.kind === "boolean") {
      if (typeof raw === "boolean") entries.push([f.name, raw]);
      else if (f.required) entries.push([f.name, f.default === true]);
      continue;
    }
    if (f.kind === "multiselect") {
      const picked = Array.isArray(raw) ? raw.filter((v) => f.options.some((o) => o.value === v)) : [];
      if (!picked.length && !f.required) continue;
      if (!picked.length) fail("required: pick at least one");
      else if (f.minItems !== undefined && picked.length < f.minItems) fail(`pick at least ${f.minItems}`);
      else if (f.maxItems !== undefined && picked.length > f.maxItems) fail(`pick at most ${f.maxItems}`);
      else entries.push([f.name, picked]);
      continue;
    }
    const s = typeof raw === "string" ? raw : "";
    const t = f.kind === "string" ? s : s.trim();
    if (t === "") {
      if (f.required) fail("required");
      continue;
    }
    if (f.kind === "select") {
      if (f.options.some((o) => o.value === t)) entries.push([f.name, t]);
      else fail("pick one of the choices");
    } else if (f.kind === "number" || f.kind === "integer") {
      const n = Number(t);
      if (!Number.isFinite(n)) fail("a number");
      else if (f.kind === "integer" && !Number.isInteger(n)) fail("a whole number");
      else if (f.minimum !== undefined && n < f.minimum) fail(`at least ${f.minimum}`);
      else if (f.maximum !== undefined && n > f.maximum) fail(`at most ${f.maximum}`);
      else entries.push([f.name, n]);
    } else if (f.kind === "string") {
      const len = Array.from(t).length;
      const fmt = f.format ? formatError(f.format, t) : null;
      if (f.minLength !== undefined && len < f.minLength) fail(`at least ${f.minLength} characters`);
      else if (len > f.maxLength) fail(`at most ${f.maxLength} characters`);
      else if (fmt) fail(fmt);
      else entries.push([f.name, t]);
    } else {
      fail("unsupported");
    }
  }
  // fromEntries defines own properties: a field named "__proto__" stays a field.
  const content = Object.fromEntries(entries);
  if (!errors.size && new TextEncoder().encode(JSON.stringify(content)).length > LIMITS.content) {
    errors.set("", `the answer is larger than ${LIMITS.content / 1024} KiB`);
  }
  return { content: errors.size ? null : content, errors, blocked: false };
}

/** The `resume` entry answering interrupt `id` with `action` ("accept" with `content`, "decline", "cancel"). */
export function answer(id, action, content) {
  const payload = action === "accept" && content ? { action, content } : { action };
  return { interruptId: id, status: "resolved", payload };
}
