// Validates Kubernetes objects against the API's OpenAPI schemas, offline, with the npm package
// kubernetes-models (its bundled JSON schemas + ajv). Run by deploy_files_test.sh:
//   node deploy_schema_check.mjs NODE_MODULES_DIR OBJECTS.json
// OBJECTS.json: an array of objects (the manifests, converted by deploy_files_check.py k8s-json).
import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modules, file] = process.argv.slice(2);
const docs = JSON.parse(readFileSync(file, "utf8"));
let failed = 0;
for (const doc of docs) {
  const [group, version] = doc.apiVersion.includes("/") ? doc.apiVersion.split("/") : ["", doc.apiVersion];
  const module = join(modules, "kubernetes-models", group, version, `${doc.kind}.js`);
  const what = `${doc.kind}/${doc.metadata?.name}`;
  if (!existsSync(module)) {
    console.log(`FAIL: ${what}: no schema for ${doc.apiVersion} ${doc.kind}`);
    failed++;
    continue;
  }
  const Model = (await import(pathToFileURL(module).href))[doc.kind];
  try {
    new Model(doc).validate();
    console.log(`schema ok: ${what}`);
  } catch (e) {
    console.log(`FAIL: ${what}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
