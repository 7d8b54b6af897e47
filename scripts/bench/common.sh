# Sourced by the bench scripts here: helpers for the servers they start.

# wait_ready URL: waits (up to 5 minutes: llama-server may load slowly) until URL/health answers 200; fails otherwise.
wait_ready() {
  for _ in $(seq 1 1500); do
    if python3 -c "import httpx,sys; sys.exit(0 if httpx.get('$1/health', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
      return 0
    fi
    sleep 0.2
  done
  echo "the server at $1 did not become ready" >&2
  return 1
}
