# Sourced by the benchmark scripts: writes the request bodies they send, as
# wrk scripts, into a directory.
#
#   json        one short user message
#   json_big    61 short messages, about 20 KB (a long chat)
#   json_agent  a 12 KB system prompt and 40 messages, about 25 KB: an
#               agent's turn, whose opening repeats on every request
#   sse         json with "stream": true
#   sse_fp      sse, its model "fingerprint": the mock's chunks carry a
#               system_fingerprint (a `g` in every event, as OpenAI's and
#               llama.cpp's have)
#
# write_conv_bodies adds conv_chat, conv_messages and conv_responses: one
# conversation in the three conversation APIs (big_body), to compare the
# routes request for request.

# wrk_script FILE BODY
wrk_script() {
  cat >"$1" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '$2'
LUA
}

# messages COUNT: COUNT user/assistant messages of about 330 bytes, comma-led.
bench_messages() {
  local filler i role out=""
  filler=$(printf 'lorem ipsum dolor sit amet, consectetur adipiscing elit. %.0s' 1 2 3 4 5)
  for i in $(seq 0 $(($1 - 1))); do
    role=user; [ $((i % 2)) = 1 ] && role=assistant
    out+=",{\"role\":\"$role\",\"content\":\"message $i $filler\"}"
  done
  printf '%s' "$out"
}

write_bodies() {
  local dir="$1" rules
  mkdir -p "$dir"
  wrk_script "$dir/json.lua" '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
  wrk_script "$dir/sse.lua" '{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  wrk_script "$dir/sse_fp.lua" '{"model":"fingerprint","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  wrk_script "$dir/json_big.lua" \
    "{\"model\":\"bench\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}$(bench_messages 60)]}"
  rules=$(printf 'Rule %s: read the file before you edit it, keep the diff small, run the tests. %.0s' $(seq 1 300))
  wrk_script "$dir/json_agent.lua" \
    "{\"model\":\"bench\",\"messages\":[{\"role\":\"system\",\"content\":\"$rules\"}$(bench_messages 40)]}"
}

# big_body API BLOCKS FILE [PER_MESSAGE]: one huge conversation of BLOCKS
# short text blocks (PER_MESSAGE to a message, default 10), alternating
# user and assistant, in API's wire shape (chat: content parts; messages:
# Anthropic text blocks and a `system` member; responses: `input` message
# items of input_text/output_text parts and `instructions`). The same
# conversation in each API, so their costs compare block for block.
# About 35 bytes a block (Responses: 40): 880,000 Messages blocks are
# ~31 MB, 300,000 Responses items ~12 MB.
big_body() {
  python3 - "$@" <<'PY'
import json, sys
api, blocks, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
per = int(sys.argv[4]) if len(sys.argv) > 4 else 10
system = "You are a helpful assistant."
msgs = []
for m in range((blocks + per - 1) // per):
    role = "user" if m % 2 == 0 else "assistant"
    n = min(per, blocks - m * per)
    texts = [f"b{m * per + b}" for b in range(n)]
    if api == "chat":
        parts = [{"type": "text", "text": t} for t in texts]
        msgs.append({"role": role, "content": parts})
    elif api == "messages":
        parts = [{"type": "text", "text": t} for t in texts]
        msgs.append({"role": role, "content": parts})
    else:
        kind = "input_text" if role == "user" else "output_text"
        parts = [{"type": kind, "text": t} for t in texts]
        msgs.append({"type": "message", "role": role, "content": parts})
if api == "chat":
    body = {"model": "bench", "messages": [{"role": "system", "content": system}] + msgs}
elif api == "messages":
    body = {"model": "bench", "max_tokens": 64, "system": system, "messages": msgs}
else:
    body = {"model": "bench", "instructions": system, "input": msgs}
with open(path, "w") as f:
    json.dump(body, f, separators=(",", ":"))
PY
}

# write_conv_bodies DIR BLOCKS: DIR/conv_{chat,messages,responses}.lua, the
# same conversation of about BLOCKS short text blocks in each API's wire
# shape, ending on a user message as an agent's request does (an odd number
# of 10-block messages).
write_conv_bodies() {
  local dir="$1" blocks=$(( $2 / 20 * 20 + 10 )) api
  mkdir -p "$dir"
  for api in chat messages responses; do
    big_body "$api" "$blocks" "$dir/conv_$api.json"
    wrk_script "$dir/conv_$api.lua" "$(cat "$dir/conv_$api.json")"
  done
}
