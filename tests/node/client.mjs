// Drives sandfleet with nothing but the `nats` npm package: create, exec, events, destroy.
// Usage: node client.mjs nats://127.0.0.1:4222 [CREDS_FILE]
import { readFileSync } from "node:fs";
import { connect, JSONCodec, nkeyAuthenticator } from "nats";

// A sandfleet credentials file holds an nkey user seed: the client signs the server's nonce with it.
const seed = process.argv[3] && readFileSync(process.argv[3], "utf8").match(/^\s*(SU[A-Z2-7]{56})\s*$/m)[1];
const nc = await connect({ servers: process.argv[2] ?? "nats://127.0.0.1:4222",
                           ...(seed ? { authenticator: nkeyAuthenticator(new TextEncoder().encode(seed)) } : {}) });
const jc = JSONCodec();

async function call(subject, body, timeout = 30000) {
  const msg = await nc.request(subject, jc.encode(body), { timeout });
  if (msg.headers?.get("Nats-Service-Error-Code")) {
    throw new Error(`${subject}: ${JSON.stringify(jc.decode(msg.data))}`);
  }
  return jc.decode(msg.data);
}

const { id, node } = await call("sandbox.v1.create", { isolation: "process", cpu: 0.5, memory_mb: 64, timeout_s: 60, labels: { from: "node" }, host_view: true });

const seen = [];
const sub = nc.subscribe(`events.v3.sandbox.*.${node}.${id}.>`);  // *: its tenant's name, `_` for none; its node's word only
const stopped = (async () => {
  for await (const m of sub) {
    const ev = jc.decode(m.data);
    seen.push(ev.type);
    if (ev.type === "sandbox.stopped") break;
  }
})();

const r = await call(`node.v1.${node}.exec`, { sandbox_id: id, argv: ["sh", "-c", "echo hello from $0", "node"] });
const stdout = Buffer.from(r.stdout, "base64").toString();  // bytes travel as base64 in JSON

await call(`node.v1.${node}.destroy`, { sandbox_id: id });
await stopped;
console.log(JSON.stringify({ id, node, exit_code: r.exit_code, stdout, events: seen }));
await nc.close();
