"""Replies of a vLLM engine started in a fresh process, as JSON: vLLM keeps one engine per process,
so tests compare an engine of other options (prefix caching off, compiled mode) with the module's
own through this script.

    python tests/vllm_replies.py SPEC_JSON STEERS_JSON CONVS OUT_JSON

SPEC_JSON is a BackendSpec's fields; STEERS_JSON a list of `--steer` lists; each runs over the
conversations test_vllm names CONVS (CONVS or LONG), greedy, with log-probs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def as_json(reply) -> dict:
    """What the comparisons read of a Reply."""
    return {"token_ids": reply.token_ids, "text": reply.text, "finish_reason": reply.finish_reason,
            "logprobs": [e.logprob for e in reply.logprobs] if reply.logprobs is not None else None,
            "pi": reply.trace.decode.tolist() if reply.trace is not None else None, "activation": reply.activation,
            "gate": reply.gate}


def main(spec: str, steers: str, convs: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import test_vllm
    from driftlab.chat import BackendSpec, ChatRequest, make_backend
    from driftlab.steering import Interventions

    backend = make_backend(BackendSpec.model_validate(json.loads(spec)))
    replies = [[as_json(r) for r in backend.generate(ChatRequest(getattr(test_vllm, convs), test_vllm.GREEDY, interventions=Interventions.parse(s),
                                                                 logprobs=0))]
               for s in json.loads(steers)]
    Path(out).write_text(json.dumps({"describe": backend.describe(), "replies": replies}))
    backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
