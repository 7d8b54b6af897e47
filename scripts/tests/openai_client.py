#!/usr/bin/env python3
"""`tinygpt serve` against the official `openai` Python client (run by scripts/test.sh).

Starts `tinygpt --backend cpu serve SmolLM2-135M-Instruct.Q4_1.gguf --api-key ...` on a free loopback
port, then: a streaming chat whose text equals `tinygpt run`'s greedy text for the same rendered
prompt, the same request whole with exact usage, a text completion, the model list, and the errors
the client raises for a wrong key, an unknown model and an unsupported parameter.

Usage: openai_client.py TINYGPT_BINARY MODEL.gguf
"""
import json
import re
import subprocess
import sys
import time

import openai  # pinned by scripts/test.sh

BIN, MODEL = sys.argv[1], sys.argv[2]
KEY = "tinygpt-test-key"
QUESTION = "What is the capital of France?"


def run_greedy(prompt, n):
    out = subprocess.run(
        [BIN, "--backend", "cpu", "run", MODEL, "-p", prompt, "-n", str(n), "--temperature", "0",
         "--format", "json"], check=True, capture_output=True, text=True)
    v = json.loads(out.stdout)
    return v["text"], len(v["generated_ids"]), len(v["prompt_ids"])


def main():
    server = subprocess.Popen(
        [BIN, "--backend", "cpu", "serve", MODEL, "--port", "0", "--api-key", KEY],
        stderr=subprocess.PIPE, text=True)
    try:
        base = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = server.stderr.readline()
            if not line:
                raise SystemExit("the server exited before it was ready")
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                base = m.group(1)
            if line.startswith("ready:"):
                break
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY)

        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
        text, usage, finish = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        # SmolLM2's chat template renders one user message so (with its default system message):
        # `tinygpt run` continues the same text.
        rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\n" + QUESTION
                    + "<|im_end|>\n<|im_start|>assistant\n")
        want, n_gen, n_prompt = run_greedy(rendered, 24)
        assert text == want, f"streamed chat {text!r} != tinygpt run {want!r}"
        assert usage.prompt_tokens == n_prompt, (usage, n_prompt)
        assert usage.completion_tokens == n_gen, (usage, n_gen)
        assert finish in ("stop", "length"), finish

        whole = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=24, temperature=0)
        assert whole.choices[0].message.content == want
        assert whole.usage.total_tokens == n_prompt + n_gen

        comp = client.completions.create(model="SmolLM2-135M-Instruct",
                                         prompt="The capital of France is", max_tokens=8,
                                         temperature=0)
        want, _, _ = run_greedy("The capital of France is", 8)
        assert comp.choices[0].text == want, (comp.choices[0].text, want)

        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]

        try:
            openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
        try:
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("an unknown model was accepted")
        except openai.NotFoundError as e:
            assert "gpt-4" in str(e)
        try:
            client.chat.completions.create(model="SmolLM2-135M-Instruct", n=2,
                                           messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("n = 2 was accepted")
        except openai.BadRequestError as e:
            assert "n = 2" in str(e), e
        print(f"openai {openai.__version__} client against tinygpt serve: all checks passed")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
