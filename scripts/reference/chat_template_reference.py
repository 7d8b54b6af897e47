"""Chat template references.

  python chat_template_reference.py transformers   (transformers environment)
      SmolLM2's own template (tokenizer.chat_template of its GGUF) rendered by transformers'
      apply_chat_template -> tests/data/chat_template/smollm2_transformers.json
  python chat_template_reference.py llamacpp       (llama-cpp-python environment)
      llama.cpp's built-in renderings (llama_chat_apply_template) for "chatml" and "gemma", the
      fallback when a file carries no template (Gemma 3 270M has none), and llama.cpp's token ids of
      the transformers rendering -> tests/data/chat_template/llamacpp_builtin.json
"""

import ctypes
import json
import sys

from common import CHAT_MESSAGES, DATA, check_model, write_json

OUT = DATA / "chat_template"

CONVERSATIONS = {
    "two_turns": CHAT_MESSAGES,
    "with_system": [
        {"role": "system", "content": "You are a pirate. Answer in one sentence."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    "single_user": [{"role": "user", "content": "Say hi."}],
}


def transformers_mode():
    import transformers
    from transformers import AutoTokenizer

    path = check_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases = []
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            cases.append(
                {
                    "name": name,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "rendered": tok.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=add_generation_prompt
                    ),
                }
            )
    write_json(
        OUT / "smollm2_transformers.json",
        {
            "tool": f"transformers {transformers.__version__} apply_chat_template (tokenizer loaded from the GGUF)",
            "template": tok.chat_template,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "cases": cases,
        },
    )


def llamacpp_mode():
    import llama_cpp

    from llamacpp_reference import LLAMA_CPP_COMMIT, tokenize

    def apply(template: str, messages, add_ass: bool) -> str:
        # Keep the encoded strings alive while llama.cpp reads them.
        encoded = [(m["role"].encode(), m["content"].encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(messages))(
            *[llama_cpp.llama_chat_message(role=r, content=c) for r, c in encoded]
        )
        cap = 4096
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), add_ass, buf, cap)
        if n < 0 or n > cap:
            raise RuntimeError(f"{template}: llama_chat_apply_template returned {n}")
        return buf.raw[:n].decode()

    cases = []
    for template in ("chatml", "gemma"):
        for name, messages in CONVERSATIONS.items():
            for add_ass in (True, False):
                cases.append(
                    {
                        "template": template,
                        "name": name,
                        "messages": messages,
                        "add_generation_prompt": add_ass,
                        "rendered": apply(template, messages, add_ass),
                    }
                )
    # llama.cpp's ids of transformers' rendering (parse_special = true, as llama.cpp does for chat).
    hf = json.loads((OUT / "smollm2_transformers.json").read_text())
    llm = llama_cpp.Llama(model_path=str(check_model("smollm2")), n_ctx=64, vocab_only=True, verbose=False)
    ids = []
    for case in hf["cases"]:
        ids.append(
            {
                "name": case["name"],
                "add_generation_prompt": case["add_generation_prompt"],
                "ids": tokenize(llm._model.vocab, case["rendered"].encode(), True, True),
            }
        )
    write_json(
        OUT / "llamacpp_builtin.json",
        {
            "tool": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {LLAMA_CPP_COMMIT}) llama_chat_apply_template",
            "cases": cases,
            "smollm2_transformers_rendering_ids": ids,
        },
    )


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "transformers":
        transformers_mode()
    elif mode == "llamacpp":
        llamacpp_mode()
    else:
        raise SystemExit("usage: chat_template_reference.py transformers|llamacpp")
