// Plays a conversation with the real `ollama` JavaScript client (npm `ollama`, pinned in
// package.json) and prints what it got, one JSON object per request, on stdout.
//
//   node ollama_chat.mjs < spec.json
//
// spec: {host, model, system, tools, turns: [user text...], stream, options?}. Each turn's user
// text is sent with the whole history; a reply with tool calls is answered with the tool's
// result ({role: "tool", content, tool_name, tool_call_id}, the same result as
// ollama_costs.tool_result) and sent again. Per request the output has the response's status and
// x-compactor-* headers (seen through the client's `fetch` option), the assembled content, the
// tool calls, the final object's prompt_eval_count and, streamed, every chunk as parsed.
import { Ollama } from 'ollama'

const input = await new Promise((resolve) => {
  let data = ''
  process.stdin.on('data', (c) => { data += c })
  process.stdin.on('end', () => resolve(data))
})
const spec = JSON.parse(input)

let last = null
const client = new Ollama({
  host: spec.host,
  fetch: async (url, init) => {
    const r = await fetch(url, init)
    last = { status: r.status, headers: Object.fromEntries(r.headers) }
    return r
  },
})

function toolResult(name, args) {
  args = args && typeof args === 'object' ? args : {}
  if (name === 'get_weather') return JSON.stringify({ city: args.city ?? null, forecast: 'sunny, 21 C' })
  return JSON.stringify({ run: args.run ?? null, status: 'ok' })
}

const messages = spec.system ? [{ role: 'system', content: spec.system }] : []
for (const [turn, text] of spec.turns.entries()) {
  messages.push({ role: 'user', content: text })
  for (let round = 0; round < 4; round++) {
    const req = { model: spec.model, messages, stream: !!spec.stream }
    if (spec.tools) req.tools = spec.tools
    if (spec.options) req.options = spec.options
    let content = ''
    let toolCalls = []
    let final = null
    const chunks = []
    let error = null
    try {
      if (spec.stream) {
        for await (const part of await client.chat(req)) {
          chunks.push(part)
          content += part.message?.content ?? ''
          toolCalls = toolCalls.concat(part.message?.tool_calls ?? [])
          final = part
        }
      } else {
        final = await client.chat(req)
        content = final.message?.content ?? ''
        toolCalls = final.message?.tool_calls ?? []
      }
    } catch (e) {
      error = { name: e.name, message: e.message, status: e.status_code ?? null }
    }
    const h = last?.headers ?? {}
    process.stdout.write(JSON.stringify({
      turn,
      status: last?.status ?? null,
      action: h['x-compactor-action'] ?? null,
      session: h['x-compactor-session'] ?? null,
      content_type: h['content-type'] ?? null,
      content,
      tool_calls: toolCalls,
      prompt_eval_count: final?.prompt_eval_count ?? null,
      response: spec.stream ? null : final,
      chunks: spec.stream ? chunks : null,
      error,
    }) + '\n')
    if (error) process.exit(1)
    const reply = { role: 'assistant', content }
    if (toolCalls.length) reply.tool_calls = toolCalls
    messages.push(reply)
    if (!toolCalls.length) break
    for (const c of toolCalls) {
      const m = { role: 'tool', content: toolResult(c.function.name, c.function.arguments), tool_name: c.function.name }
      if (c.id) m.tool_call_id = c.id
      messages.push(m)
    }
  }
}
