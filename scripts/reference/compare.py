"""Agreement between llama.cpp and transformers on the recorded prompts.

Reads llamacpp.json / hf.json and the full last-position logits kept in .cache/reference/ by the two
scripts; writes tests/data/reference/agreement.json and prints a table.

  nmse            sum((a - b)^2) / sum(a^2) over the last-position logits, a = llama.cpp, b = transformers
  prompt_top1     fraction of prompt positions whose argmax agrees
  forced_top1     fraction of llama.cpp's 32 greedy steps whose argmax transformers reproduces when
                  fed llama.cpp's own continuation (teacher forcing)
  greedy_prefix   how many of the 32 greedy tokens the two free-running continuations share
  min_forced_gap  the smallest top-1/top-2 logit gap (llama.cpp) among the forced steps, to spot
                  near-ties where a disagreement is expected
"""

import json

import numpy as np

from common import DATA, MODELS, SCRATCH, read_f32, write_json


def main():
    rows = []
    for key in MODELS:
        ref = DATA / "reference" / key
        llama = json.loads((ref / "llamacpp.json").read_text())
        hf = json.loads((ref / "hf.json").read_text())
        for lp, hp in zip(llama["prompts"], hf["prompts"]):
            assert lp["name"] == hp["name"] and lp["ids"] == hp["ids"]
            name = lp["name"]
            a = np.asarray(read_f32(SCRATCH / key / f"llamacpp_{name}_last_logits.f32.bin"), dtype=np.float64)
            b = np.asarray(read_f32(SCRATCH / key / f"hf_{name}_last_logits.f32.bin"), dtype=np.float64)
            nmse = float(np.sum((a - b) ** 2) / np.sum(a**2))
            prompt_top1 = np.mean([x[0] == y[0] for x, y in zip(lp["prompt_top2"], hp["prompt_top2"])])
            forced = hp["llamacpp_continuation_top2"]
            forced_top1 = np.mean([x[0] == y[0] for x, y in zip(lp["greedy_top2"], forced)])
            disagreements = [
                {"step": i, "llamacpp": x, "transformers": y}
                for i, (x, y) in enumerate(zip(lp["greedy_top2"], forced))
                if x[0] != y[0]
            ]
            prefix = 0
            for x, y in zip(lp["greedy_ids"], hp["greedy_ids"]):
                if x != y:
                    break
                prefix += 1
            gaps = [x[1] - x[3] for x in lp["greedy_top2"]]
            rows.append(
                {
                    "model": key,
                    "prompt": name,
                    "n_prompt_tokens": len(lp["ids"]),
                    "nmse_last_logits": nmse,
                    "max_abs_diff_last_logits": float(np.max(np.abs(a - b))),
                    "prompt_top1_agreement": float(prompt_top1),
                    "forced_top1_agreement": float(forced_top1),
                    "forced_disagreements": disagreements,
                    "greedy_common_prefix": prefix,
                    "min_forced_top2_gap_llamacpp": float(min(gaps)),
                }
            )
    write_json(
        DATA / "reference" / "agreement.json",
        {
            "description": __doc__.strip(),
            "llamacpp": json.loads((DATA / "reference" / "smollm2" / "llamacpp.json").read_text())["tool"],
            "transformers": json.loads((DATA / "reference" / "smollm2" / "hf.json").read_text())["tool"],
            "rows": rows,
        },
    )
    print(f"{'model':8} {'prompt':8} {'NMSE':>10} {'maxdiff':>8} {'prompt@1':>8} {'forced@1':>8} {'prefix':>6} {'mingap':>7}")
    for r in rows:
        print(
            f"{r['model']:8} {r['prompt']:8} {r['nmse_last_logits']:10.3e} {r['max_abs_diff_last_logits']:8.3f} "
            f"{r['prompt_top1_agreement']:8.3f} {r['forced_top1_agreement']:8.3f} {r['greedy_common_prefix']:6d} "
            f"{r['min_forced_top2_gap_llamacpp']:7.3f}"
        )


if __name__ == "__main__":
    main()
