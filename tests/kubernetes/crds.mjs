// Validates custom resources against the schemas the @kubernetes-models packages
// (npm, pinned in the Makefile) generate from prometheus-operator's and Gateway API's
// own CRDs. Usage: node crds.mjs NODE_MODULES < manifests.json (a JSON array); prints
// one JSON line per manifest: {"kind", "name", "error"} (error null when valid).
// Exit 3 if a kind has no schema here.
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const MODELS = {};
for (const [pkg, group, kind] of [
  ["prometheus-operator", "monitoring.coreos.com/v1", "PodMonitor"],
  ["prometheus-operator", "monitoring.coreos.com/v1", "PrometheusRule"],
  ["gateway-api", "gateway.networking.k8s.io/v1", "HTTPRoute"],
]) {
  const file = join(modules, "@kubernetes-models", pkg, group, `${kind}.js`);
  MODELS[`${group}/${kind}`] = (await import(pathToFileURL(file)))[kind];
}

let input = "";
for await (const chunk of process.stdin) input += chunk;
let unknown = false;
for (const doc of JSON.parse(input)) {
  const Model = MODELS[`${doc.apiVersion}/${doc.kind}`];
  let error = null;
  if (!Model) {
    error = `no schema for ${doc.apiVersion} ${doc.kind}`;
    unknown = true;
  } else {
    try {
      new Model(doc).validate();
    } catch (e) {
      error = String(e.message || e);
    }
  }
  console.log(JSON.stringify({ kind: doc.kind, name: doc.metadata?.name, error }));
}
process.exit(unknown ? 3 : 0);
