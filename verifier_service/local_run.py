"""Run the pair locally on the embedded defaults and send it sample requests.

    python -m verifier_service.local_run ["prompt" ...] [--max-new-tokens 96] [--data data]

Starts the drafter (its LMDB table under ``data/drafter``, kept between runs)
and the verifier (the default model) as child processes on free loopback
ports, waits until both report SERVING, then sends each prompt twice through
``Generate``: plain (K=0) and speculative (K chosen by the server). It prints
the text, the statistics, the speedup and whether the tokens are identical,
then stops both services. Without prompts it sends an input-grounded task
(quoting documentation: drafts copied from the prompt are accepted in long
runs) and an open question.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import sys
import textwrap
import time
from pathlib import Path

import grpc

from specdec.processes import ServiceProcess, local_drafter
from specdec.v1 import verifier_pb2, verifier_pb2_grpc

SAMPLE_DOC = "\n\n".join(pydoc_data.topics.topics["assert"].split("\n\n")[:4])
SAMPLE_PROMPTS = (
    "Here is documentation from the Python reference:\n\n"
    + SAMPLE_DOC
    + "\n\nQuote the sentences that explain the extended form, word for word.",
    "What is speculative decoding in language models? Answer in two sentences.",
)


def generate(stub, prompt: str, max_new_tokens: int, k: int | None) -> tuple[verifier_pb2.GenerateResponse, float]:
    request = verifier_pb2.GenerateRequest(prompt=prompt, chat=True, max_new_tokens=max_new_tokens)
    if k is not None:
        request.num_speculative_tokens = k
    started = time.perf_counter()
    response = stub.Generate(request, timeout=600)
    return response, time.perf_counter() - started


def report(label: str, response: verifier_pb2.GenerateResponse, elapsed: float) -> None:
    stats = response.stats
    print(f"=== {label}\n" + textwrap.indent(response.text.strip(), "  "))
    print(
        f"    {stats.generated_tokens} tokens in {elapsed:.2f}s ({stats.generated_tokens / elapsed:.1f} tok/s), "
        f"forward passes={stats.target_forward_passes}, drafted={stats.draft_tokens}, "
        f"accepted={stats.accepted_tokens} ({stats.acceptance_rate:.0%}), "
        f"tokens/forward pass={stats.tokens_per_forward_pass:.2f}, TTFT={stats.time_to_first_token_ms:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=list(SAMPLE_PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--data", type=Path, default=Path("data"), help="folder for the drafter's LMDB table")
    args = parser.parse_args(argv)
    processes: list[ServiceProcess] = []
    try:
        drafter = local_drafter(args.data)
        processes.append(drafter)
        verifier = ServiceProcess(
            "verifier_service", "--port", "0", "--metrics-port", "-1", "--http-port", "0", "--drafter", drafter.address, inherit_stderr=True
        )
        processes.append(verifier)
        http_port = verifier.announced_port("http")
        print(f"drafter on {drafter.address}, verifier on {verifier.address}; waiting for the model...")
        print(f"(while this runs, its OpenAI-compatible API and live view are at http://127.0.0.1:{http_port}/)", flush=True)
        verifier.wait_until_serving()
        with grpc.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            for prompt in args.prompts:
                print("\n=== prompt\n" + textwrap.indent(prompt.strip(), "  "))
                plain, plain_s = generate(stub, prompt, args.max_new_tokens, k=0)
                report("plain (K=0)", plain, plain_s)
                speculative, speculative_s = generate(stub, prompt, args.max_new_tokens, k=None)
                report("speculative (adaptive K)", speculative, speculative_s)
                same = list(plain.token_ids) == list(speculative.token_ids)
                print(f"=== {plain_s / speculative_s:.2f}x faster; identical tokens: {same}")
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    finally:
        for process in reversed(processes):
            process.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
