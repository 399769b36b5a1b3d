"""Every `KEEL_*` variable, declared once: kind, default, unit, readers, doc.

Code reads a variable only through its declaration here and the parsers of
services.common.setting; the README's configuration table is generated from
this list (`keel config --markdown`), and tests/test_settings_registry.py
fails when a name is read but not declared, declared but read nowhere, or
the README's table differs. `keel_client` and `keel_tools` are shipped alone
and read their variables by name: they are declared here too, with the
package as a reader.
"""

from __future__ import annotations

from services.common.setting import SERVICES, Setting

ALL = SERVICES
MiB = 1 << 20


def _int(name: str, default: int | None, doc: str, *readers: str, **more: object) -> Setting:
    return Setting(name, "int", default, doc, readers, **more)  # type: ignore[arg-type]


def _ms(name: str, default: int, doc: str, *readers: str, minimum: int = 0) -> Setting:
    return Setting(name, "millis", default, doc, readers, unit="ms", minimum=minimum)


def _text(name: str, default: str, doc: str, *readers: str, **more: object) -> Setting:
    return Setting(name, "text", default, doc, readers, **more)  # type: ignore[arg-type]


def _choice(name: str, choices: tuple[str, ...], doc: str, *readers: str) -> Setting:
    return Setting(name, "choice", choices[0], doc, readers, choices=choices)


def _test(name: str, default: str, doc: str) -> Setting:
    return Setting(name, "text", default, doc, ("tests",), scope="test")


# --- every process (services.common.config.Settings)
KEEL_DATABASE_URL = _text(
    "KEEL_DATABASE_URL",
    "",
    "a `postgresql://` URL selects PostgreSQL; otherwise SQLite files under `KEEL_DATA_DIR`",
    *ALL,
    "bench",
)
KEEL_DATA_DIR = _text(
    "KEEL_DATA_DIR",
    ".keel",
    "where `keel up` runs: SQLite files, blobs, the discovery file, the kept dev key",
    *ALL,
)
KEEL_PG_SCHEMA = _text("KEEL_PG_SCHEMA", "public", "PostgreSQL schema of Keel's tables", *ALL)
KEEL_LEASE_MS = _int(
    "KEEL_LEASE_MS",
    30_000,
    "a lease's TTL: how long a silent runner keeps a session",
    "kernel",
    "runner",
    "cli",
    unit="ms",
)
KEEL_MAX_FACT_BYTES = _int(
    "KEEL_MAX_FACT_BYTES",
    MiB,
    "the ledger's limit on one fact's JSON (refused as `FACT_TOO_LARGE`); the runner cuts "
    "answers and tool results to it with a note",
    *ALL,
    unit="bytes",
)
KEEL_GRPC_MAX_MESSAGE_BYTES = _int(
    "KEEL_GRPC_MAX_MESSAGE_BYTES",
    16 * MiB,
    "every gRPC server's and channel's message limit, at least the fact limit + 64 KiB",
    *ALL,
    unit="bytes",
)
KEEL_INTERNAL_TOKEN = _text(
    "KEEL_INTERNAL_TOKEN",
    "",
    "the token every internal gRPC call carries (at least 24 characters, 10 different)",
    *ALL,
    "bench",
    secret=True,
)
KEEL_GRPC_TLS_CERT = _text(
    "KEEL_GRPC_TLS_CERT", "", "internal gRPC over TLS: this process's certificate (PEM file)", *ALL
)
KEEL_GRPC_TLS_KEY = _text(
    "KEEL_GRPC_TLS_KEY", "", "internal gRPC over TLS: its private key (PEM file)", *ALL
)
KEEL_GRPC_TLS_CA = _text(
    "KEEL_GRPC_TLS_CA", "", "internal gRPC over TLS: the CA both sides check (mutual TLS)", *ALL
)
KEEL_GRPC_TLS_SERVER_NAME = _text(
    "KEEL_GRPC_TLS_SERVER_NAME",
    "",
    "the name checked in servers' certificates when it is not the address dialled",
    *ALL,
)
KEEL_OTEL_EXPORTER = _text(
    "KEEL_OTEL_EXPORTER",
    "none",
    "`none`, `console` or `otlp` (to the standard `OTEL_EXPORTER_OTLP_*` endpoints)",
    *ALL,
    "bench",
    choices=("none", "console", "otlp"),
)
KEEL_LOG_LEVEL = _text("KEEL_LOG_LEVEL", "INFO", "the log level of every Keel logger", *ALL)

# --- secrets and tools policy (services.common.secrets)
KEEL_SECRET_GRANTS = _text(
    "KEEL_SECRET_GRANTS",
    "",
    "which variables each tenant's loadout may name: `tenant=VAR[,VAR…];…`",
    *ALL,
)
KEEL_PROVIDER_ORIGINS = _text(
    "KEEL_PROVIDER_ORIGINS",
    "",
    "comma-separated `http(s)://host[:port]` a model's `baseUrl` may call; unset: the "
    "official provider APIs, empty: none",
    *ALL,
)
KEEL_MCP_COMMANDS = _text(
    "KEEL_MCP_COMMANDS",
    "",
    "`;`-separated whole command lines runners may start, each optionally `tenant=`; unset: none",
    *ALL,
)
KEEL_TOOL_TARGETS = _text(
    "KEEL_TOOL_TARGETS",
    "",
    "comma-separated `host:port`, `grpcs://host:port` or `http(s)://host[:port]`, each "
    "optionally `tenant=`; `*` for development only; unset: none",
    *ALL,
)

# --- runner (services.runner.config, agent_io.tools)
KEEL_RUNTIME_ID = _text(
    "KEEL_RUNTIME_ID", "", "the runner's runtime id (default: a new random one)", "runner"
)
KEEL_RUNNER_CONCURRENCY = _int(
    "KEEL_RUNNER_CONCURRENCY", 8, "attempts one runner works on at once", "runner"
)
KEEL_CLAIM_WAIT_MS = _int(
    "KEEL_CLAIM_WAIT_MS", 1_000, "the long poll of one claim", "runner", unit="ms"
)
KEEL_RUNNER_CACHED_FACTS = _int(
    "KEEL_RUNNER_CACHED_FACTS", 100_000, "facts a runner keeps in memory between attempts", "runner"
)
KEEL_CONTEXT_WINDOW = _int(
    "KEEL_CONTEXT_WINDOW",
    128_000,
    "the context window of a loadout that names none",
    "runner",
    "compaction",
    unit="tokens",
)
KEEL_COMPACTION_ADDRESS = _text(
    "KEEL_COMPACTION_ADDRESS",
    "",
    "a compaction service elsewhere (default: the runner embeds one)",
    "runner",
)
KEEL_STICKY_MS = _ms(
    "KEEL_STICKY_MS",
    30_000,
    "how long a runner keeps a session after answering; 0: never",
    "runner",
    "bench",
)
KEEL_SIGTERM_MODE = _choice(
    "KEEL_SIGTERM_MODE",
    ("shutdown", "handoff"),
    "what SIGTERM does to a runner's attempts: stop them, or hand them off at a commit boundary",
    "runner",
)
KEEL_DRAIN_DEADLINE_MS = _ms(
    "KEEL_DRAIN_DEADLINE_MS",
    30_000,
    "how long a handoff drain waits for commit boundaries (SIGTERM, `keel drain`)",
    "runner",
    "edge",
    "cli",
)
KEEL_ADVERTISE_ADDRESS = _text(
    "KEEL_ADVERTISE_ADDRESS",
    "",
    "the runner's address as other pods reach it, when it listens on a wildcard",
    "runner",
    "cli",
)
KEEL_TOOL_TIMEOUT_S = Setting(
    "KEEL_TOOL_TIMEOUT_S",
    "number",
    60,
    "a tool call's timeout when its source sets none",
    ("runner",),
    unit="s",
)
KEEL_TOOL_MAX_RESULT_BYTES = Setting(
    "KEEL_TOOL_MAX_RESULT_BYTES",
    "number",
    65_536,
    "the most a tool result holds before it is cut; a source may only lower it",
    ("runner",),
    unit="bytes",
)
KEEL_TOOL_TOKEN = _text(
    "KEEL_TOOL_TOKEN",
    "",
    "sent to gRPC ToolServices as `x-keel-tool-token` (never Keel's internal token); "
    "checked by `keel_tools` servers; 24+ characters, 10 different",
    "runner",
    "cli",
    "keel_tools",
    secret=True,
)
KEEL_TOOL_TOKENS = _text(
    "KEEL_TOOL_TOKENS",
    "",
    "`;`-separated `[tenant=]target=KEEL_TOOL_TOKEN_NAME` (`*` for every target): a token per "
    "ToolService or tenant, the most specific entry winning",
    "runner",
    "cli",
)
KEEL_TOOL_TOKEN_ = Setting(
    "KEEL_TOOL_TOKEN_",
    "text",
    "",
    "a tool token named by `KEEL_TOOL_TOKENS` (24+ characters, 10 different)",
    ("runner", "cli"),
    secret=True,
    family=True,
)
KEEL_TOOL_TLS_CA = _text(
    "KEEL_TOOL_TLS_CA", "", "the CA for `grpcs://` tool targets (default: system roots)", "runner"
)
KEEL_TOOL_SANDBOX = _choice(
    "KEEL_TOOL_SANDBOX",
    ("auto", "off"),
    "how MCP stdio servers are kept from the runner's secrets; `off`: started as before",
    "runner",
)
KEEL_TOOL_UID = _int(
    "KEEL_TOOL_UID",
    65534,
    "the uid stdio tool servers run as when the runner may switch",
    "runner",
    minimum=0,
    maximum=2**32 - 2,
)
KEEL_TOOL_GID = _int(
    "KEEL_TOOL_GID",
    65534,
    "the gid stdio tool servers run as when the runner may switch",
    "runner",
    minimum=0,
    maximum=2**32 - 2,
)

# --- kernel (kernel.config)
KEEL_MAX_ATTEMPTS = _int(
    "KEEL_MAX_ATTEMPTS",
    5,
    "failed attempts before a session is parked (a failure retrying cannot fix parks it at once)",
    "kernel",
    minimum=1,
)
KEEL_BACKOFF_BASE_MS = _ms(
    "KEEL_BACKOFF_BASE_MS", 1_000, "backoff after a failure: base * 2^(n-1)", "kernel"
)
KEEL_BACKOFF_CAP_MS = _ms("KEEL_BACKOFF_CAP_MS", 60_000, "the longest backoff", "kernel")
KEEL_MAX_RATE_LIMITED = _int(
    "KEEL_MAX_RATE_LIMITED",
    20,
    "rate-limited attempts before a session is parked (counted apart)",
    "kernel",
    minimum=1,
)
KEEL_RETRY_AFTER_CAP_MS = _ms(
    "KEEL_RETRY_AFTER_CAP_MS",
    900_000,
    "the longest a provider's `retry-after` is honoured",
    "kernel",
)
KEEL_RECONCILE_MS = _ms(
    "KEEL_RECONCILE_MS",
    5_000,
    "how often owing sessions are re-read (lost wake-ups)",
    "kernel",
    minimum=10,
)
KEEL_RECONCILE_GRACE_MS = _ms(
    "KEEL_RECONCILE_GRACE_MS",
    10_000,
    "how long an owing session may go unqueued before a warning",
    "kernel",
)
KEEL_CLAIM_RECHECK_MS = _ms(
    "KEEL_CLAIM_RECHECK_MS",
    500,
    "how often a waiting claim re-checks the store",
    "kernel",
    minimum=10,
)
KEEL_SWEEP_MS = _ms(
    "KEEL_SWEEP_MS",
    0,
    "how often expired leases are swept; 0: a tenth of the TTL (50 ms to 1 s)",
    "kernel",
)
KEEL_ATTACH_HEARTBEAT_MS = _ms(
    "KEEL_ATTACH_HEARTBEAT_MS",
    2_000,
    "a message on every Attach stream this often",
    "kernel",
    minimum=100,
)
KEEL_RUNTIME_RETENTION_MS = _ms(
    "KEEL_RUNTIME_RETENTION_MS",
    3_600_000,
    "how long the kernel lists a runtime that went away",
    "kernel",
    minimum=1_000,
)
KEEL_RUNTIME_HEARTBEAT_MS = _ms(
    "KEEL_RUNTIME_HEARTBEAT_MS",
    1_000,
    "each kernel's heartbeat for its attached runtimes",
    "kernel",
    minimum=10,
)
KEEL_RUNTIME_DEAD_AFTER_MS = _ms(
    "KEEL_RUNTIME_DEAD_AFTER_MS",
    3_000,
    "a runtime not beaten for this long (database clock) died with its kernel; at least twice "
    "the heartbeat",
    "kernel",
    minimum=20,
)

# --- edge (edge.limits, services.blobs)
KEEL_EDGE_FAILED_KEYS_BURST = _int(
    "KEEL_EDGE_FAILED_KEYS_BURST",
    20,
    "unknown API keys one address may try at once",
    "edge",
    minimum=1,
)
KEEL_EDGE_FAILED_KEYS_WINDOW_S = Setting(
    "KEEL_EDGE_FAILED_KEYS_WINDOW_S",
    "number",
    60,
    "the window over which that burst refills",
    ("edge",),
    unit="s",
)
KEEL_EDGE_TRACKED_ADDRESSES = _int(
    "KEEL_EDGE_TRACKED_ADDRESSES",
    10_000,
    "client addresses remembered for failed keys",
    "edge",
    minimum=1,
)
KEEL_EDGE_STREAMS_PER_KEY = _int(
    "KEEL_EDGE_STREAMS_PER_KEY",
    200,
    "event streams one API key may hold open",
    "edge",
    "bench",
    minimum=1,
)
KEEL_EDGE_STREAMS_PER_TENANT = _int(
    "KEEL_EDGE_STREAMS_PER_TENANT",
    1000,
    "event streams one tenant may hold open",
    "edge",
    "bench",
    minimum=1,
)
KEEL_EDGE_HEADER_TIMEOUT_S = Setting(
    "KEEL_EDGE_HEADER_TIMEOUT_S",
    "number",
    10,
    "how long a request's head may take to arrive",
    ("edge",),
    unit="s",
)
KEEL_EDGE_BODY_TIMEOUT_S = Setting(
    "KEEL_EDGE_BODY_TIMEOUT_S",
    "number",
    10,
    "how long a request body may stall",
    ("edge",),
    unit="s",
)
KEEL_EDGE_BODY_MIN_BYTES_PER_S = _int(
    "KEEL_EDGE_BODY_MIN_BYTES_PER_S",
    500,
    "a body gets a second more per this many bytes received",
    "edge",
    unit="bytes/s",
    minimum=1,
)
KEEL_EDGE_TRUSTED_PROXIES = Setting(
    "KEEL_EDGE_TRUSTED_PROXIES",
    "list",
    (),
    "comma-separated proxies whose `X-Forwarded-For` names the client (an ingress)",
    ("edge",),
)
KEEL_EDGE_MAX_BODY_BYTES = _int(
    "KEEL_EDGE_MAX_BODY_BYTES",
    MiB,
    "the largest JSON body or public gRPC request: 413 / `PAYLOAD_TOO_LARGE` over it",
    "edge",
    unit="bytes",
    minimum=1,
)
KEEL_EDGE_MAX_HEAD_BYTES = _int(
    "KEEL_EDGE_MAX_HEAD_BYTES",
    32 << 10,
    "the largest request head (431 over it)",
    "edge",
    unit="bytes",
    minimum=1,
)
KEEL_EDGE_MAX_HEADERS = _int(
    "KEEL_EDGE_MAX_HEADERS",
    100,
    "the most header lines in a request (431 over it)",
    "edge",
    minimum=1,
)
KEEL_EDGE_KEEP_ALIVE_S = Setting(
    "KEEL_EDGE_KEEP_ALIVE_S",
    "number",
    75,
    "how long an idle connection stays open (longer than load balancers keep theirs)",
    ("edge",),
    unit="s",
)
KEEL_BLOB_QUOTA_COUNT = _int(
    "KEEL_BLOB_QUOTA_COUNT", 10_000, "blobs one tenant may hold", "edge", minimum=1
)
KEEL_BLOB_QUOTA_BYTES = _int(
    "KEEL_BLOB_QUOTA_BYTES",
    1 << 30,
    "bytes one tenant's blobs may declare",
    "edge",
    unit="bytes",
    minimum=1,
)

# --- the CLI and its clients
KEEL_DEV_KEY = _text(
    "KEEL_DEV_KEY",
    "",
    "`keel up`'s dev key (an operator key); default: one kept in the data dir",
    "cli",
    "bench",
    secret=True,
)
KEEL_API_KEY = _text(
    "KEEL_API_KEY",
    "",
    "the API key of `keel` client commands (and the client's examples)",
    "cli",
    "keel_client",
    secret=True,
)
KEEL_URL = _text(
    "KEEL_URL", "", "the edge URL of `keel` client commands (default: the running `keel up`)", "cli"
)
KEEL_GRPC_BASE_PORT = _int(
    "KEEL_GRPC_BASE_PORT",
    None,
    "`keel up`: internal gRPC ports from this one up (default: free ports)",
    "cli",
    minimum=1,
    maximum=65535,
)
KEEL_METRICS_PORT = _int(
    "KEEL_METRICS_PORT",
    None,
    "serve Prometheus metrics on this port (off unless set)",
    "cli",
    minimum=1,
    maximum=65535,
)
KEEL_METRICS_HOST = _text(
    "KEEL_METRICS_HOST", "127.0.0.1", "the host the metrics port listens on", "cli"
)

# --- fault injection, request recording: tests and `keel chaos` only
KEEL_FAULT_POINT = Setting(
    "KEEL_FAULT_POINT",
    "text",
    "",
    "`name[@n]`: the fault point acted at (the n-th time)",
    ALL,
    scope="test",
)
KEEL_FAULT_ACTION = Setting(
    "KEEL_FAULT_ACTION",
    "choice",
    "freeze",
    "what a fault point does: `freeze`, `stop` or `drain`",
    ALL,
    choices=("freeze", "stop", "drain"),
    scope="test",
)
KEEL_FAULT_TRIGGER = Setting(
    "KEEL_FAULT_TRIGGER",
    "text",
    "",
    "a file naming the point to act at (one process takes it)",
    ALL,
    scope="test",
)
KEEL_FAULT_INJECT = Setting(
    "KEEL_FAULT_INJECT",
    "list",
    (),
    "bugs planted to test the checkers (`duplicate_reply`)",
    ("runner",),
    scope="test",
)
KEEL_RECORD_REQUESTS = Setting(
    "KEEL_RECORD_REQUESTS",
    "text",
    "",
    "a file the scripted model appends each request to",
    ("runner", "compaction"),
    scope="test",
)

# --- the test suite and the benchmarks
KEEL_TEST_DATABASE_URL = _test(
    "KEEL_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test", "the tests' PostgreSQL"
)
KEEL_TEST_PG_BIN = _test(
    "KEEL_TEST_PG_BIN", "/usr/lib/postgresql/15/bin", "PostgreSQL binaries of throwaway servers"
)
KEEL_OUTAGE_LEASE_MS = _test("KEEL_OUTAGE_LEASE_MS", "6000", "the TTL of tests/test_pg_outage.py")
KEEL_FUZZ_EXAMPLES = _test("KEEL_FUZZ_EXAMPLES", "", "fuzz examples per operation (a longer hunt)")
KEEL_SHARED_DIR = _test("KEEL_SHARED_DIR", "", "another copy of the shared conformance cases")
KEEL_BENCH_PEERS_DSN = Setting(
    "KEEL_BENCH_PEERS_DSN",
    "text",
    "",
    "the PostgreSQL of `keel bench peers`' peer programs",
    ("bench",),
    scope="bench",
)

SETTINGS: tuple[Setting, ...] = tuple(
    value for value in dict(globals()).values() if isinstance(value, Setting)
)
BY_NAME = {setting.name: setting for setting in SETTINGS}


def declared(variable: str) -> Setting | None:
    """The declaration of `variable` (a family member's too), or None."""
    exact = BY_NAME.get(variable)
    if exact is not None:
        return exact
    return next((s for s in SETTINGS if s.family and s.matches(variable)), None)
