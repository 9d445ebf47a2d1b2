// An agent in another language: no evalpipe code, no package, only the OpenAI-compatible
// endpoint its environment names (docs/agents.md "An agent in another language").
//   evalpipe run SUITE --agent 'cmd:node examples/agents/node_agent.mjs'
// The case arrives as JSON on stdin; the answer goes to stdout. In a run, OPENAI_BASE_URL is
// the run's model gateway and OPENAI_API_KEY a token of this sample's: its calls are recorded
// (trajectory, tokens, cost), capped and replayed like any agent's.
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const kase = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const question = kase.inputs.question ?? kase.inputs.prompt ?? JSON.stringify(kase.inputs);
const base = process.env.OPENAI_BASE_URL ?? "https://api.openai.com/v1";
const answer = await fetch(`${base}/chat/completions`, {
  method: "POST",
  headers: {"Content-Type": "application/json", Authorization: `Bearer ${process.env.OPENAI_API_KEY}`},
  body: JSON.stringify({model: process.env.AGENT_MODEL ?? "gpt-4o-mini",
                        messages: [{role: "user", content: question}]}),
});
if (!answer.ok) {
  console.error(`HTTP ${answer.status}: ${await answer.text()}`);
  process.exit(1);
}
const reply = await answer.json();
process.stdout.write(reply.choices[0].message.content ?? "");
