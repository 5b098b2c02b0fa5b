"""Fill the Hugging Face cache with a model (or only its tokenizer) for runs that cannot reach the Hub.

    python -m zerotrain.fetch meta-llama/Llama-3.1-8B                  # config, safetensors weights, tokenizer
    python -m zerotrain.fetch meta-llama/Llama-3.1-8B@main --tokenizer-only
    HF_HUB_OFFLINE=1 python -m zerotrain.fetch meta-llama/Llama-3.1-8B  # only checks the cache

Run it on a login node with internet and the same ``HF_HUB_CACHE`` / ``HF_HOME`` as the jobs (a shared file
system); jobs then run with ``HF_HUB_OFFLINE=1`` and ``model.pretrained_path=meta-llama/Llama-3.1-8B``. Gated
models (Llama) need ``HF_TOKEN`` of an account that accepted the licence. Prints the snapshot directory; exit 2,
with the reason, when the id cannot be resolved. Fetches what zerotrain.hub.resolve would (the same files).
"""

from __future__ import annotations

import sys

from zerotrain import hub

PROG = "python -m zerotrain.fetch"


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0 if argv else 2
    tokenizer_only = "--tokenizer-only" in argv
    specs = [a for a in argv if a != "--tokenizer-only"]
    unknown = [a for a in specs if a.startswith("-")]
    if unknown or len(specs) != 1 or hub.parse(specs[0]) is None:
        print(f"error: {PROG}: give one Hub id org/name[@revision] and optionally --tokenizer-only "
              f"(got: {' '.join(argv)})", file=sys.stderr)
        return 2
    try:
        path = hub.resolve(specs[0], "fetch", tokenizer_only=tokenizer_only)
    except hub.HubError as e:
        print(f"error: {PROG}: {e}", file=sys.stderr)
        return e.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
