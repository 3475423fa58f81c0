# Sourced by the benchmark scripts: writes the request bodies they send, as
# wrk scripts, into a directory.
#
#   json        one short user message
#   json_big    61 short messages, about 20 KB (a long chat)
#   json_agent  a 12 KB system prompt and 40 messages, about 25 KB: an
#               agent's turn, whose opening repeats on every request
#   sse         json with "stream": true

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
  wrk_script "$dir/json_big.lua" \
    "{\"model\":\"bench\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful assistant.\"}$(bench_messages 60)]}"
  rules=$(printf 'Rule %s: read the file before you edit it, keep the diff small, run the tests. %.0s' $(seq 1 300))
  wrk_script "$dir/json_agent.lua" \
    "{\"model\":\"bench\",\"messages\":[{\"role\":\"system\",\"content\":\"$rules\"}$(bench_messages 40)]}"
}
