"""python -m verifier_service --port PORT --drafter HOST:PORT [--model NAME_OR_PATH]

Flags also come from SPECDEC_VERIFIER_* environment variables (flag name in
upper case, dashes as underscores: SPECDEC_VERIFIER_MAX_BATCH_SIZE).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from specdec.serving import add_serving_flags, announce, env_default, serving_options, stop_on_signals
from verifier_service.server import DEFAULT_METRICS_PORT, VerifierConfig, create_server

ENV_PREFIX = "SPECDEC_VERIFIER_"


def parse_config(argv: list[str] | None = None) -> VerifierConfig:
    defaults = VerifierConfig()

    def env(name: str, default):
        return env_default(ENV_PREFIX, name, default)

    parser = argparse.ArgumentParser(prog="python -m verifier_service", description="speculative-decoding verifier gRPC service")
    parser.add_argument("--host", default=env("host", defaults.host))
    parser.add_argument("--port", type=int, default=int(env("port", defaults.port)), help="0 picks a free port")
    parser.add_argument("--model", default=env("model", defaults.model), help="the embedded default or a Hugging Face model path/name")
    parser.add_argument("--device", default=env("device", defaults.device), help="cpu, cuda, cuda:1 (default: CUDA when present)")
    parser.add_argument(
        "--dtype",
        default=env("dtype", defaults.dtype),
        choices=["float32", "bfloat16", "auto"],
        help="weights and activations (auto: bfloat16 where the hardware has native bf16)",
    )
    parser.add_argument("--drafter", default=env("drafter", defaults.drafter), help="host:port of the drafter (omit: no speculation)")
    parser.add_argument("--drafter-timeout", type=float, default=float(env("drafter_timeout", defaults.drafter_timeout_s)))
    parser.add_argument("--max-batch-size", type=int, default=int(env("max_batch_size", defaults.max_batch_size)))
    parser.add_argument("--max-queued", type=int, default=int(env("max_queued", defaults.max_queued)))
    parser.add_argument("--max-new-tokens-limit", type=int, default=int(env("max_new_tokens_limit", defaults.max_new_tokens_limit)))
    parser.add_argument(
        "--max-sequence-tokens",
        type=int,
        default=_optional_int(env("max_sequence_tokens", defaults.max_sequence_tokens)),
        help="KV cache positions per request, prompt + max_new_tokens (default: the model's context, at most 4096)",
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=int(env("prefill_chunk_tokens", defaults.prefill_chunk_tokens)),
        help="prompt tokens one step may prefill alongside the running sequences",
    )
    parser.add_argument(
        "--max-speculative-tokens",
        type=int,
        default=int(env("max_speculative_tokens", defaults.max_speculative_tokens)),
        help="the most draft tokens a request may ask to verify per step (num_speculative_tokens)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(env("max_message_bytes", defaults.max_message_bytes)),
        help="gRPC message size cap, both ways",
    )
    parser.add_argument(
        "--stop-strings-limit",
        type=int,
        default=int(env("stop_strings_limit", defaults.stop_strings_limit)),
        help="stop strings one request may give",
    )
    parser.add_argument(
        "--stop-string-length-limit",
        type=int,
        default=int(env("stop_string_length_limit", defaults.stop_string_length_limit)),
        help="characters per stop string",
    )
    parser.add_argument(
        "--grace", type=float, default=float(env("grace", defaults.grace_s)), help="seconds SIGTERM gives in-flight requests"
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        default=env("no_calibrate", "") == "1",
        help="skip the start-up step-cost measurement (tests, tiny models)",
    )
    add_serving_flags(parser, ENV_PREFIX, DEFAULT_METRICS_PORT)
    parser.add_argument("--drafter-tls-ca", default=env("drafter_tls_ca", None), help="PEM root certificate: reach the drafter over TLS")
    parser.add_argument(
        "--drafter-tls-cert",
        default=env("drafter_tls_cert", None),
        help="PEM client certificate for a drafter that requires one (with --drafter-tls-key and --drafter-tls-ca)",
    )
    parser.add_argument("--drafter-tls-key", default=env("drafter_tls_key", None))
    args = parser.parse_args(argv)
    for name in (
        "max_batch_size",
        "max_queued",
        "max_new_tokens_limit",
        "max_sequence_tokens",
        "prefill_chunk_tokens",
        "stop_strings_limit",
        "stop_string_length_limit",
        "max_message_bytes",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_speculative_tokens < 0:
        parser.error(f"--max-speculative-tokens must be >= 0, got {args.max_speculative_tokens}")
    serving = serving_options(parser, args)
    if bool(args.drafter_tls_cert) != bool(args.drafter_tls_key):
        parser.error("--drafter-tls-cert and --drafter-tls-key go together")
    if args.drafter_tls_cert and not args.drafter_tls_ca:
        parser.error("--drafter-tls-cert needs --drafter-tls-ca: a client certificate is sent over TLS only")
    return VerifierConfig(
        port=args.port,
        host=args.host,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        drafter=args.drafter,
        drafter_timeout_s=args.drafter_timeout,
        max_batch_size=args.max_batch_size,
        max_queued=args.max_queued,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_sequence_tokens=args.max_sequence_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        max_speculative_tokens=args.max_speculative_tokens,
        max_message_bytes=args.max_message_bytes,
        stop_strings_limit=args.stop_strings_limit,
        stop_string_length_limit=args.stop_string_length_limit,
        grace_s=args.grace,
        calibrate=not args.no_calibrate,
        drafter_tls_ca=args.drafter_tls_ca,
        drafter_tls_cert=args.drafter_tls_cert,
        drafter_tls_key=args.drafter_tls_key,
        **serving,
    )


def _optional_int(value) -> int | None:
    return None if value in (None, "") else int(value)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    stopping = stop_on_signals()
    logging.info("effective config (flags, SPECDEC_VERIFIER_* variables, defaults): %s", config)
    verifier = create_server(config)
    # Health answers NOT_SERVING from here on while the model loads.
    announce("verifier", config.host, verifier.port, verifier.metrics_port, f"model {config.model}", verifier.health_port)
    failures: list[Exception] = []

    def load() -> None:
        try:
            verifier.load()
        except Exception as error:  # a bad model path, no memory: say so and exit, never hang NOT_SERVING
            logging.exception("could not load model %s", config.model)
            failures.append(error)
            stopping.set()

    threading.Thread(target=load, name="verifier-load", daemon=True).start()
    stopping.wait()
    drained = verifier.stop()
    if failures:  # the last line, for whoever reads a failed start: exit 1
        reason = " ".join(str(failures[0]).split()) or type(failures[0]).__name__
        sys.exit(f"verifier: cannot serve --model {config.model}: {reason}")
    logging.info("stopped %s", "cleanly" if drained else "after cancelling requests past the grace period")
    sys.exit(0)


if __name__ == "__main__":
    main()
