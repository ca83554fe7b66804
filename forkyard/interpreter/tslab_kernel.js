// The JavaScript and TypeScript kernels: tslab (npm, installed globally in the template), started as
// `tslab kernel` starts it, with what makes its cells answer like E2B's code interpreter:
// - the value of a cell's last expression is the cell's execute_result (its main result), not a
//   line on stdout (tslab prints it with console.log); an object with a
//   [Symbol.for("Jupyter.display")]() method gives its MIME bundle (as Deno's kernel does);
// - each cell announces its execution count (execute_input), as Jupyter kernels do, and a silent
//   execution (the server's, e.g. setting environment variables) counts nothing and shows no result;
// - a failed cell does not make the cells sent in the next 200 ms fail too (tslab aborts its queue
//   for that long after an error; the server sends one cell at a time, so nothing is queued).
// Usage: node tslab_kernel.js <connection file> [--js]
"use strict";

const fs = require("fs");
const path = require("path");
const util = require("util");

/** The installed tslab package: where the `tslab` on PATH links to. */
function tslabRoot() {
  for (const dir of (process.env.PATH || "").split(path.delimiter)) {
    const bin = path.join(dir, "tslab");
    if (fs.existsSync(bin)) {
      return path.dirname(path.dirname(fs.realpathSync(bin)));
    }
  }
  throw new Error("tslab is not on PATH");
}

const root = tslabRoot();
const jupyter = require(path.join(root, "dist", "jupyter.js"));
const executor = require(path.join(root, "dist", "executor.js"));
const main = require(path.join(root, "dist", "main.js"));
const tslabUtil = require(path.join(root, "dist", "util.js"));

const DISPLAY = Symbol.for("Jupyter.display");
/** Sends a cell's value as its execute_result; set while a cell runs. */
let sendResult = null;

function mimeBundle(value) {
  if (value !== null && typeof value === "object" && typeof value[DISPLAY] === "function") {
    const bundle = value[DISPLAY]();
    if (bundle && typeof bundle === "object") {
      return bundle;
    }
  }
  // console.log's text (strings as they are, other values inspected), which tslab printed.
  return { "text/plain": util.format(value) };
}

// tslab's executor writes the last expression's value with the console it is given, and only that
// value (its errors go to console.error): that console's log becomes the cell's result.
const createExecutor = executor.createExecutor;
executor.createExecutor = (rootDir, convs, console) =>
  createExecutor(rootDir, convs, {
    log: (value) => (sendResult ? sendResult(mimeBundle(value)) : console.log(value)),
    error: console.error,
  });

// tslab's own handleExecute (jupyter.js, 1.0.22), plus execute_input and the result writer.
jupyter.ZmqServer.prototype.handleExecute = async function (sock, msg) {
  const key = this.connInfo.key;
  const publish = (type, content) => {
    const out = msg.createReply();
    out.header.msg_type = type;
    out.content = content;
    out.signAndSend(key, this.iopub);
  };
  const silent = Boolean(msg.content.silent);
  const before = this.handler.execCount;
  const count = before + 1; // the handler counts every execution, failed ones too
  if (!silent) {
    publish("execute_input", { code: msg.content.code, execution_count: count });
  }
  const writeStream = (name, text) => publish("stream", { name, text });
  const writeDisplayData = (data, update) => publish(update ? "update_display_data" : "display_data", data);
  sendResult = silent
    ? () => {}
    : (data) => publish("execute_result", { execution_count: count, data, metadata: {} });
  let content;
  try {
    content = await this.handler.handleExecute(msg.content, writeStream, writeDisplayData);
  } finally {
    sendResult = null;
    if (silent) {
      this.handler.execCount = before;
    }
  }
  if (silent) {
    content = { ...content, execution_count: before };
  }
  const reply = msg.createReply();
  reply.header.msg_type = "execute_reply";
  reply.content = content;
  reply.signAndSend(key, sock);
};

tslabUtil.TaskQueue.prototype.reset = function () {
  this.prev = Promise.resolve();
};

const args = process.argv.slice(2);
main.startKernel({
  configPath: args.find((a) => !a.startsWith("--")),
  jsKernel: args.includes("--js"),
  // A node_modules/tslab in the user's directory would replace this patched kernel.
  enableFindLocal: false,
  globalVersion: tslabUtil.getVersion(),
});
