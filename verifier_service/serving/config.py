"""The verifier's settings: ``VerifierConfig``, one frozen dataclass whose fields (the
engine's, the scheduler's, the drafter link's and the connections' nested) are the flags
and SPECDEC_VERIFIER_* variables (``specdec.flags``), with the checks that make a bad
combination a usage error. No gRPC or HTTP serving here: the service layer and both
front doors import it, and it imports none of them."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from specdec import serving, settings
from specdec.flags import nested, setting
from specdec.limits import ConnectionLimits
from verifier_service.core.engine import EngineConfig
from verifier_service.core.model_loading import DEFAULT_MODEL, DEFAULT_MODEL_HUB_NAME
from verifier_service.head.model import DEFAULT_HEAD_VOCABULARY
from verifier_service.head.proposer import DEFAULT_HEAD_DEPTH
from verifier_service.serving.drafter_client import DrafterClientConfig
from verifier_service.serving.scheduler import SchedulerConfig
from verifier_service.serving.scopes import KeyEntry, given_secret, parse_key_line

DEFAULT_METRICS_PORT = 9102  # the drafter's is 9101

# --help groups (specdec.flags).
SERVER, MODEL, DRAFTER, HTTP = "server", "model", "drafter (--drafter HOST:PORT,...)", "HTTP API"
CALLERS, ENGINE, CONNECTIONS = "callers, API keys and learning scopes", "engine and batching", "gRPC connections"


@dataclass(frozen=True)
class VerifierConfig:
    """The service's settings, the engine's and the scheduler's nested: each field is a flag
    and a SPECDEC_VERIFIER_* variable (``specdec.flags``)."""

    port: int = setting(50052, group=SERVER, help="gRPC port (0: a free one)")
    host: str = setting("127.0.0.1", group=SERVER, help="address to bind")
    model: str = setting(DEFAULT_MODEL, group=MODEL, help="the embedded default, or any Hugging Face causal LM path or name")
    # vLLM's flag: clients name the model as they know it.
    served_model_name: str | None = setting(
        None,
        group=MODEL,
        help="names the HTTP API answers to, comma-separated; the first is the one it reports (none: --model, and for the "
        f"default model also {DEFAULT_MODEL_HUB_NAME})",
    )
    device: str | None = setting(None, group=MODEL, help="cpu, cuda, cuda:1 (none: CUDA when present, else CPU)")
    # The form (core/forms.py): every form auto takes is exact, and the fastest of them on
    # this machine is measured at start-up and kept in the cache folder for later starts.
    dtype: str = setting(
        "auto",
        group=MODEL,
        choices=["auto", "float32", "bfloat16"],
        help="activations and float weights (auto: the fastest exact form measured at start-up: float32, or bfloat16 with "
        "batch-invariant passes where the hardware computes it natively; float32 is transformers' own arithmetic)",
    )
    # int4 reads a quarter of bfloat16's weight bytes; core/weights.py says what it keeps exact.
    weights: str = setting(
        "auto",
        group=MODEL,
        choices=["auto", "float", "int4", "int8"],
        help="the linear layers' weights: float (in --dtype), int4 in groups of 32 (a Q4_1 GGUF's own integers) or int8 with "
        "a scale per output, both with bfloat16 activations, on the CPU (need --dtype bfloat16 or auto) "
        "(auto: float or int4, whichever is faster here, measured at start-up)",
    )
    threads: int = setting(
        0,
        group=MODEL,
        minimum=0,
        help="threads torch computes with (0: torch's default or one, whichever is faster here, measured at start-up)",
    )
    # Trained by python -m verifier_service.head.train; refused when trained on another model.
    # Off by default: on a 2-core CPU it pays for one sequence but not yet for 16
    # (docs/benchmarks.md: the draft head), and a default must not slow any batch down.
    draft_head: str = setting(
        "none",
        group=MODEL,
        help="a trained draft head's folder; auto: the one trained for this model in the cache folder "
        "($SPECDEC_CACHE_DIR/draft-heads), if there is one; none: no head",
    )
    draft_head_vocabulary: int = setting(
        DEFAULT_HEAD_VOCABULARY,
        group=MODEL,
        minimum=0,
        formerly=["head-vocabulary"],
        help="the draft head drafts only its this many most frequent tokens (0: all it was trained on): fewer weights read a level",
    )
    # Each level is one small batched matmul chain; the planner verifies only the
    # head tokens whose measured acceptance pays for their place in the pass.
    draft_head_depth: int = setting(
        DEFAULT_HEAD_DEPTH,
        group=MODEL,
        minimum=0,
        formerly=["head-depth"],
        help="tokens deep the trained draft head (--draft-head) drafts per step (0: none)",
    )
    # How the verifier reaches the drafter: --drafter HOST:PORT (or replicas, comma-separated) and the --drafter-* flags.
    drafter: DrafterClientConfig = nested(DrafterClientConfig, prefix="drafter-", group=DRAFTER)
    # A 4K-token prompt as ids is ~20 KB.
    max_message_bytes: int = setting(serving.MAX_MESSAGE_BYTES, group=SERVER, minimum=1, help="gRPC message size cap, both ways")
    grace_s: float = setting(10.0, group=SERVER, minimum=0.0, help="seconds SIGTERM gives in-flight requests")
    http_port: int = setting(
        8000, group=HTTP, minimum=-1, help="OpenAI-compatible HTTP API and the live view at / (0: a free one, -1: off)"
    )
    # Off by default, so make run, the benchmarks and a loopback-only deployment need
    # none; anything reachable from a network should set keys. Not in the config's repr
    # (the start-up log). The flag can take one key only (flags.py has no repeated flags):
    # several go comma-separated, or one a line in --api-key-file.
    api_key: str | None = setting(
        None,
        group=CALLERS,
        repr=False,
        help="API key(s), comma-separated, that /v1 and gRPC Generate/GenerateStream require as "
        "'authorization: Bearer KEY' (none: open). A command line is visible to local users: prefer the variable or --api-key-file",
    )
    api_key_file: str | None = setting(
        None,
        group=CALLERS,
        help="file of API keys, one a line, each optionally followed by scope=NAME: keys of one scope share what the drafter "
        "learns from them, and each other key learns alone ('#' comments and blank lines skipped); adds to --api-key",
    )
    # The drafter is told a keyed hash of each caller's scope, never a key: without the
    # secret nobody can name another caller's scope. Not in the config's repr.
    scope_secret: str | None = setting(
        None,
        group=CALLERS,
        repr=False,
        help="secret (16+ characters) that learning scopes' ids are keyed with; verifiers sharing a drafter share what "
        "they learn for a key only with one secret (none: --scope-secret-file, else one kept in the cache folder)",
    )
    scope_secret_file: str | None = setting(None, group=CALLERS, help="file holding --scope-secret (its first line)")
    # A fleet-wide table of text that is safe to share: every caller's drafts read it,
    # only its own keys write it.
    shared_scope: str | None = setting(
        None,
        group=CALLERS,
        help="a scope named in --api-key-file whose learned text every caller's drafts also read (none: each reads its own only)",
    )
    # Half of the default batch and queue (16 + 64): one client cannot take every
    # slot and queue place, while 16-client benchmarks from one host still fit.
    max_requests_per_caller: int = setting(
        40,
        group=CALLERS,
        minimum=1,
        help="requests one caller (API key; else client certificate; else address) may have in flight, over HTTP and gRPC together",
    )
    # OpenAI allows 128. Each choice is a sequence of its own (a batch slot, a caller's
    # place): 8 leaves a default batch of 16 room for another such request.
    max_choices: int = setting(
        8,
        group=CALLERS,
        minimum=1,
        help="choices (n) one HTTP request may ask for; each is a sequence, counted against --max-requests-per-caller",
    )
    # None: what the cache can hold could never need more characters: a position
    # per token, each at most the tokenizer's longest token plus one separator a
    # whitespace pre-tokenizer drops (SmolLM2: 4,096 x (81 + 1), ~336K). Checked before any
    # template or tokenizer runs, so a huge text costs no tokenizing.
    max_prompt_chars: int | None = setting(
        None,
        group=CALLERS,
        minimum=1,
        help="characters of prompt text (a chat's contents together) accepted before tokenizing "
        "(none: the per-request cache positions x (the tokenizer's longest token + 1))",
    )
    # A 4,096-token prompt is ~20-100 KB of JSON; 1 MiB holds a 128K-token one, and with
    # --max-http-connections bounds what half-sent bodies can hold (256 MiB).
    max_http_body_bytes: int = setting(
        1 << 20,
        minimum=1,
        group=HTTP,
        formerly=["http-max-body-bytes"],
        help="HTTP request body cap in bytes (413 beyond; from Content-Length first)",
    )
    # Headers arrive in one packet; 10 s allows a very slow link and still frees a
    # slow-loris connection quickly.
    http_header_timeout_s: float = setting(10.0, group=HTTP, minimum=0.001, help="seconds a client may take to send a request's headers")
    # The whole body, from its headers: a 1 MiB body at ~17 KB/s.
    http_body_timeout_s: float = setting(60.0, group=HTTP, minimum=0.001, help="seconds a client may take to send a request's body")
    # 3x the 80 requests the scheduler holds (16 + 64), room for clients' idle
    # keep-alive connections, and well inside a 1,024 open-file limit.
    max_http_connections: int = setting(
        256, minimum=1, group=HTTP, formerly=["http-max-connections"], help="open HTTP connections; beyond, new ones get 503 and are closed"
    )
    # Browsers refuse a page's cross-origin calls unless the server allows its origin.
    # None: no CORS headers, so only pages served from this port (the live view) call it.
    allowed_origins: str | None = setting(
        None,
        group=HTTP,
        help="origins (comma-separated, e.g. https://app.example.com; * for any) whose browser pages "
        "may call the HTTP API (none: same origin only)",
    )
    # DNS rebinding: a page on another site can have its own name resolve to this
    # server's address, then call it as same-origin, with that name in Host. Only
    # this server's own names are answered. None: the names of --host, which for a
    # loopback address are localhost, 127.0.0.1 and ::1; for all interfaces (0.0.0.0,
    # ::) any name, since the server cannot know the names clients reach it by
    # (a deployment behind a name should list it).
    allowed_hosts: str | None = setting(
        None,
        group=HTTP,
        help="host names (comma-separated, no port; * for any) the HTTP API answers to in a request's Host header "
        "(none: the --host address's: localhost, 127.0.0.1 and ::1 for a loopback address, any for 0.0.0.0 or ::)",
    )
    calibrate: bool = setting(
        True,
        group=ENGINE,
        help="measure nothing at start-up: serve from a flat step cost that real steps refine, in the first form --dtype and "
        "--weights allow (float32 for auto) (tests, tiny models)",
    )
    # Calibrating takes ~20 s on an idle 2-core machine (at most --calibration-budget-seconds);
    # a start with a stored one serves from it at once.
    calibration_cache: bool = setting(
        True,
        group=ENGINE,
        help="neither read nor keep a stored step-cost calibration or chosen form: measure them at every start. By default "
        "they are kept under the cache folder ($SPECDEC_CACHE_DIR/calibration and /forms) and served from at once at later "
        "starts (a calibration lowered when real steps show the machine faster, never replaced by a busy start's timings)",
    )
    connections: ConnectionLimits = nested(ConnectionLimits, group=CONNECTIONS)
    engine: EngineConfig = nested(EngineConfig, group=ENGINE)
    scheduler: SchedulerConfig = nested(SchedulerConfig, group=ENGINE)
    # The settings every service has (specdec.serving): health outside the request limit.
    tls_cert: str | None = settings.tls_cert_setting()
    tls_key: str | None = settings.tls_key_setting()
    tls_client_ca: str | None = settings.tls_client_ca_setting()
    metrics_port: int | None = settings.metrics_port_setting(DEFAULT_METRICS_PORT)
    health_port: int | None = settings.health_port_setting()

    def __post_init__(self) -> None:
        settings.check_tls(self.tls_cert, self.tls_key, self.tls_client_ca, settings.SERVER_TLS_FLAGS, client=False)
        entries = self.key_entries()  # fail fast: an unreadable key file or a malformed key is a usage error
        given_secret(self.scope_secret, self.scope_secret_file)  # and so is a short secret, or an unreadable file
        if self.shared_scope is not None and self.shared_scope not in {entry.scope for entry in entries}:
            raise ValueError(f"--shared-scope {self.shared_scope!r} is no scope of --api-key-file (a line 'KEY scope=NAME' names one)")
        self.origins()
        self.hosts()
        if self.weights in ("int4", "int8") and self.dtype == "float32":
            raise ValueError(f"--weights {self.weights} computes with bfloat16 activations: start it with --dtype bfloat16 (or auto)")
        if self.draft_head_vocabulary == 1:  # each drafting step takes the head's two best guesses
            raise ValueError("--draft-head-vocabulary is 0 (every token the head was trained on) or at least 2, got 1")

    def served_names(self) -> list[str]:
        """The names the HTTP API answers to, the reported one first (--served-model-name)."""
        names = [name.strip() for name in (self.served_model_name or "").split(",") if name.strip()]
        if not names:
            names = [self.model, DEFAULT_MODEL_HUB_NAME] if self.model == DEFAULT_MODEL else [self.model]
        return list(dict.fromkeys(names))

    def origins(self) -> list[str]:
        """The --allowed-origins, each a scheme://host[:port] or *."""
        origins = [origin.strip() for origin in (self.allowed_origins or "").split(",") if origin.strip()]
        for origin in origins:
            if origin != "*" and not ORIGIN_PATTERN.fullmatch(origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], no path) or *")
        return origins

    def hosts(self) -> frozenset[str] | None:
        """The names an HTTP request's Host may give (the port aside), lower case, IPv6
        addresses without brackets; None: any (--allowed-hosts, module docstring)."""
        if self.allowed_hosts is None:
            host = host_name(self.host)
            if host in ALL_INTERFACES:
                return None
            loopback = host == "localhost" or _is_loopback(host)
            return frozenset({host, *LOOPBACK_NAMES}) if loopback else frozenset({host})
        names = [name.strip() for name in self.allowed_hosts.split(",") if name.strip()]
        if "*" in names:
            return None
        for name in names:
            if not _is_host(host_name(name)):
                raise ValueError(f"--allowed-hosts: {name!r} is not a host name or address (no scheme, port or path) or *")
        if not names:
            raise ValueError("--allowed-hosts names no host: give names, or * for any")
        return frozenset(host_name(name) for name in names)

    def api_keys(self) -> tuple[str, ...]:
        """The configured keys, from --api-key and --api-key-file (``key_entries``)."""
        return tuple(entry.key for entry in self.key_entries())

    def key_entries(self) -> tuple[KeyEntry, ...]:
        """The configured keys with their scopes' names (ValueError naming where, never the
        key, for a key that cannot travel in a header, a malformed line, or an unreadable file)."""
        keys = [(key.strip(), f"key {index} of --api-key") for index, key in enumerate((self.api_key or "").split(","), 1)]
        entries = [KeyEntry(key, None) for key, where in keys if key]
        wheres = [where for key, where in keys if key]
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"cannot read --api-key-file {self.api_key_file}: {error}") from None
            listed = [(line.strip(), f"line {number} of --api-key-file") for number, line in enumerate(lines, 1)]
            listed = [(line, where) for line, where in listed if line and not line.startswith("#")]
            if not listed:
                raise ValueError(f"--api-key-file {self.api_key_file} holds no key")
            entries += [parse_key_line(line, where) for line, where in listed]
            wheres += [where for _, where in listed]
        for entry, where in zip(entries, wheres):
            if not KEY_PATTERN.fullmatch(entry.key):
                raise ValueError(f"{where}: an API key is printable ASCII without spaces or commas")
        return tuple(entries)


# What an HTTP header and gRPC metadata carry unchanged, less the --api-key separator.
KEY_PATTERN = re.compile(r"[!-+\--~]+")
# An origin as browsers send it: scheme://host[:port], no path.
ORIGIN_PATTERN = re.compile(r"[a-z][a-z0-9+.-]*://[A-Za-z0-9.\-\[\]:]+")
# A host name or an IPv4 or IPv6 address, as --allowed-hosts takes them (host_name's form).
HOST_PATTERN = re.compile(r"[a-z0-9.\-:_]+")
# --host values that bind every interface, and the names a loopback address is reached by.
ALL_INTERFACES = frozenset({"", "0.0.0.0", "::"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_host(name: str) -> bool:
    """A host name or address in host_name's form; a colon only in an IPv6 address (not a port)."""
    if not HOST_PATTERN.fullmatch(name):
        return False
    try:
        return ":" not in name or ipaddress.ip_address(name).version == 6
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """A host as Host headers are compared: lower case, an IPv6 address without its brackets,
    no trailing dot ("[::1]" -> "::1", "LocalHost." -> "localhost")."""
    return host.strip().removeprefix("[").removesuffix("]").rstrip(".").lower()
