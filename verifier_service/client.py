"""Command-line client of the verifier service.

    python -m verifier_service.client "prompt" [--stream] [--json] [--k K] [--max-new-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop STR ...] [--no-chat]
        [--target HOST:PORT] [--timeout-seconds SECONDS] [--tls-ca PATH [--tls-cert PATH --tls-key PATH]] [--api-key KEY]

Prints the generated text on stdout (chunk by chunk with --stream) and a
one-line summary of the request's statistics on stderr; with --json, one JSON
object (text, token_ids, finish_reason, stats) on stdout instead, the same for
--stream and unary calls. Without --k the server chooses the number of draft
tokens per step; --k 0 disables speculation. A verifier that requires an API key
gets it from --api-key or SPECDEC_VERIFIER_API_KEY (the variable keeps it off
the command line, which other local users can read).

Exit status: 0 on success, 2 for INVALID_ARGUMENT (the request itself is
wrong: fix the flags) or unreadable TLS files, 1 for every other gRPC error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import grpc
from google.protobuf import json_format

from specdec import serving
from specdec.v1 import verifier_pb2 as pb
from specdec.v1 import verifier_pb2_grpc as rpc

TARGET_ENV = "SPECDEC_VERIFIER_TARGET"
API_KEY_ENV = "SPECDEC_VERIFIER_API_KEY"  # the verifier's own variable for its keys: one key here
DEFAULT_TARGET = "127.0.0.1:50052"
# Long enough for a few hundred tokens on CPU behind a full batch; a deadline
# is still set so a wedged server cannot hang the client forever.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MAX_NEW_TOKENS = 128
EXIT_RPC_ERROR = 1
EXIT_INVALID_ARGUMENT = 2
FINISH_REASON_PREFIX = "FINISH_REASON_"


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    """The client's command line (``docs/reference/tools.md`` is made from it)."""
    parser = argparse.ArgumentParser(prog="python -m verifier_service.client", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="the prompt: a user message, or raw text with --no-chat")
    parser.add_argument("--stream", action="store_true", help="print text as it is accepted (GenerateStream)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text and a summary")
    parser.add_argument(
        "--max-new-tokens", type=non_negative_int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens to generate at most (default %(default)s)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off (default %(default)s)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0: off (default %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=None, help="makes sampling reproducible (default: none)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--k", type=non_negative_int, default=None, help="draft tokens per step; 0 disables speculation; omitted: the server chooses"
    )
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text, without the chat template")
    parser.add_argument("--target", default=None, help=f"HOST:PORT of the verifier (${TARGET_ENV}; default {DEFAULT_TARGET})")
    parser.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of the call (default %(default)s)")
    parser.add_argument("--timeout", dest="timeout_seconds", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # former name
    parser.add_argument("--tls-ca", type=Path, default=None, help="root certificate (PEM); given: connect with TLS")
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        help="client certificate (PEM) for a server that requires one (mutual TLS; with --tls-key and --tls-ca)",
    )
    parser.add_argument("--tls-key", type=Path, default=None, help="the key of --tls-cert (PEM)")
    parser.add_argument("--api-key", default=None, help=f"sent as 'authorization: Bearer KEY' (${API_KEY_ENV}; default: none)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser_ = parser()
    args = parser_.parse_args(argv)
    error = parser_.error
    # The variables are read here, not as defaults: --help (and the reference made from it) never shows a key.
    args.target = args.target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and "," in args.api_key:
        error(f"--api-key (or ${API_KEY_ENV}) takes one key; this one has a comma")
    if bool(args.tls_cert) != bool(args.tls_key):
        error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        error("--tls-cert needs --tls-ca: a client certificate is sent over TLS only")
    return args


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        prompt=args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
    )
    # Optional fields are assigned only when given: unset means "server's choice"
    # for num_speculative_tokens, which is not the same as 0 (no speculation).
    if args.seed is not None:
        request.seed = args.seed
    if args.k is not None:
        request.num_speculative_tokens = args.k
    return request


def open_channel(target: str, tls_ca: Path | None, tls_cert: Path | None = None, tls_key: Path | None = None) -> grpc.Channel:
    return serving.channel(target, tls_ca, tls_cert=tls_cert, tls_key=tls_key)


def join_chunks(chunks: Iterable[pb.GenerateChunk], on_text=None) -> pb.GenerateResponse:
    """Concatenate streamed chunks into the response a unary call returns.

    Chunks ("He", [5]), ("llo", [6, 7]), ("", [], STOP, stats) give
    ("Hello", [5, 6, 7], STOP, stats). on_text sees each chunk's text as it arrives.
    """
    response = pb.GenerateResponse()
    texts = []
    for chunk in chunks:
        if on_text is not None and chunk.text:
            on_text(chunk.text)
        texts.append(chunk.text)
        response.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            response.finish_reason = chunk.finish_reason
        if chunk.HasField("stats"):
            response.stats.CopyFrom(chunk.stats)
    response.text = "".join(texts)
    return response


def print_flushed(text: str) -> None:
    print(text, end="", flush=True)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call sends: the API key, when there is one."""
    return (("authorization", f"Bearer {api_key.strip()}"),) if api_key else ()


def generate(stub: rpc.VerifierStub, request: pb.GenerateRequest, args: argparse.Namespace) -> pb.GenerateResponse:
    metadata = call_metadata(getattr(args, "api_key", None))
    if not args.stream:
        return stub.Generate(request, timeout=args.timeout_seconds, metadata=metadata)
    call = stub.GenerateStream(request, timeout=args.timeout_seconds, metadata=metadata)
    try:
        response = join_chunks(call, on_text=None if args.json else print_flushed)
    finally:
        call.cancel()  # a no-op once the stream ended; frees the server's slot on Ctrl-C
    if not args.json:
        print(flush=True)
    return response


def finish_reason_name(value: int) -> str:
    """FINISH_REASON_STOP -> "stop"."""
    return pb.FinishReason.Name(value).removeprefix(FINISH_REASON_PREFIX).lower()


def response_as_dict(response: pb.GenerateResponse) -> dict:
    # MessageToDict prints float32 fields shortest-round-trip (0.8, not 0.800000011920929).
    stats = json_format.MessageToDict(response.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return {
        "text": response.text,
        "token_ids": list(response.token_ids),
        "finish_reason": finish_reason_name(response.finish_reason),
        "stats": {field.name: stats[field.name] for field in response.stats.DESCRIPTOR.fields},
    }


def stats_summary(response: pb.GenerateResponse) -> str:
    stats = response.stats
    acceptance = f"{stats.acceptance_rate:.1%} of {stats.draft_tokens} drafts" if stats.draft_tokens else "no drafts"
    return (
        f"{stats.generated_tokens} tokens, {stats.target_forward_passes} forward passes, "
        f"acceptance {acceptance}, {stats.tokens_per_forward_pass:.2f} tokens/pass, "
        f"TTFT {stats.time_to_first_token_ms:.1f} ms, total {stats.total_ms:.1f} ms, "
        f"finish {finish_reason_name(response.finish_reason)}"
    )


def report_rpc_error(error: grpc.RpcError) -> int:
    code = error.code()
    print(f"error: {code.name}: {error.details() or ''}", file=sys.stderr)
    return EXIT_INVALID_ARGUMENT if code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_RPC_ERROR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    request = build_request(args)
    try:
        channel = open_channel(args.target, args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as error:
        print(f"error: cannot read a TLS file: {error}", file=sys.stderr)
        return EXIT_INVALID_ARGUMENT
    with channel:
        try:
            response = generate(rpc.VerifierStub(channel), request, args)
        except grpc.RpcError as error:
            return report_rpc_error(error)
    if args.json:
        print(json.dumps(response_as_dict(response), ensure_ascii=False))
    else:
        if not args.stream:
            print(response.text)
        print(stats_summary(response), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
