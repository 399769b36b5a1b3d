"""One agent turn on a peer, the way a user would build it, on PostgreSQL.

Run by `keel bench peers` with the scratch venv's Python (bench/peers.py):

    KEEL_BENCH_PEERS_DSN=URL python peer_turns.py --peer langgraph|dbos \
        [--turns 100] [--sessions 50] [--each 10]

A turn is a user message made durable, an instant "model" step, and the
answer made durable:
  langgraph  StateGraph(MessagesState) with one model node and the PostgreSQL
             checkpointer: one thread in sequence (PostgresSaver), then
             `sessions` threads at once (AsyncPostgresSaver on a pool)
  dbos       a DBOS workflow per turn with one model step: one session in
             sequence, then `sessions` sessions on threads at once

Prints one JSON line per mode with every turn's latency in ms (bench/peers.py
takes the percentiles with the same code as for Keel) and the process's CPU
time (all its threads: the peer's own background work counts, as Keel's
does), or one line with "error". The peers are imported by name at run time: this file is part of
Keel's package (and its type check), where they are not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import json
import os
import threading
import time
import uuid
from typing import Any

# The PostgreSQL URL (in the environment: a command line is visible to all).
DSN_ENV = "KEEL_BENCH_PEERS_DSN"
# Turns of a throwaway session before each measured mode: connections,
# prepared statements and the peer's own setup are not a turn's cost.
WARMUP_TURNS = 3
# LangGraph's concurrent run shares one pool of this size (as its docs show).
POOL_SIZE = 20


def emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def clocks() -> tuple[float, float]:
    """Wall-clock and this process's CPU time (every thread's), to measure from."""
    return time.perf_counter(), time.process_time()


def report(
    peer: str, mode: str, sessions: int, since: tuple[float, float], latencies: list[float]
) -> None:
    wall_s = time.perf_counter() - since[0]
    cpu_s = time.process_time() - since[1]
    emit(
        {
            "peer": peer,
            "mode": mode,
            "sessions": sessions,
            "turns": len(latencies),
            "wall_s": round(wall_s, 4),
            "cpu_s": round(cpu_s, 4),
            "latencies_ms": [round(s * 1000, 3) for s in latencies],
        }
    )


def version_of(distribution: str) -> str:
    return importlib.metadata.version(distribution)


# -- LangGraph -------------------------------------------------------------


def answer_state(state: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [("ai", "You said: " + state["messages"][-1].content)]}


def langgraph_graph() -> Any:
    graph_module = importlib.import_module("langgraph.graph")
    graph = graph_module.StateGraph(graph_module.MessagesState)
    graph.add_node("model", answer_state)
    graph.add_edge(graph_module.START, "model")
    graph.add_edge("model", graph_module.END)
    return graph


def in_schema(dsn: str, schema: str) -> str:
    """The DSN with its search_path set to the run's own schema: LangGraph's
    tables stay out of the database's public schema and are dropped after."""
    separator = "&" if "?" in dsn else "?"
    return f"{dsn}{separator}options=-csearch_path%3D{schema}"


def run_langgraph(dsn: str, turns: int, sessions: int, each: int) -> None:
    psycopg = importlib.import_module("psycopg")
    schema = f"keel_peers_langgraph_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        emit({"peer": "langgraph", "version": version_of("langgraph")})
        url = in_schema(dsn, schema)
        langgraph_one_session(url, turns)
        asyncio.run(langgraph_sessions(url, sessions, each))
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def langgraph_one_session(url: str, turns: int) -> None:
    saver = importlib.import_module("langgraph.checkpoint.postgres").PostgresSaver
    with saver.from_conn_string(url) as checkpointer:
        checkpointer.setup()
        app = langgraph_graph().compile(checkpointer=checkpointer)

        def turn(thread: str, text: str) -> None:
            app.invoke({"messages": [("user", text)]}, {"configurable": {"thread_id": thread}})

        warmup = str(uuid.uuid4())
        for n in range(WARMUP_TURNS):
            turn(warmup, f"warm-up {n}")
        thread = str(uuid.uuid4())
        latencies: list[float] = []
        started = clocks()
        for n in range(turns):
            began = time.perf_counter()
            turn(thread, f"hello {n}")
            latencies.append(time.perf_counter() - began)
        report("langgraph", "one_session", 1, started, latencies)


async def langgraph_sessions(url: str, sessions: int, each: int) -> None:
    saver = importlib.import_module("langgraph.checkpoint.postgres.aio").AsyncPostgresSaver
    pool_class = importlib.import_module("psycopg_pool").AsyncConnectionPool
    dict_row = importlib.import_module("psycopg.rows").dict_row
    options = {"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row}
    async with pool_class(url, max_size=POOL_SIZE, kwargs=options, open=False) as pool:
        checkpointer = saver(pool)
        await checkpointer.setup()
        app = langgraph_graph().compile(checkpointer=checkpointer)
        latencies: list[float] = []

        async def session(count: int, measured: bool) -> None:
            config = {"configurable": {"thread_id": str(uuid.uuid4())}}
            for n in range(count):
                began = time.perf_counter()
                await app.ainvoke({"messages": [("user", f"hello {n}")]}, config)
                if measured:
                    latencies.append(time.perf_counter() - began)

        await session(WARMUP_TURNS, measured=False)
        started = clocks()
        await asyncio.gather(*(session(each, measured=True) for _ in range(sessions)))
        report("langgraph", "sessions", sessions, started, latencies)


# -- DBOS ------------------------------------------------------------------


def answer_text(text: str) -> str:
    return "You said: " + text


def dbos_system_url(dsn: str) -> str:
    """DBOS keeps its system tables in a database of its own on the same
    server (it creates it on launch)."""
    server, _, rest = dsn.rpartition("/")
    query = rest.partition("?")[2]
    return f"{server}/keel_peers_dbos" + (f"?{query}" if query else "")


def run_dbos(dsn: str, turns: int, sessions: int, each: int) -> None:
    dbos = importlib.import_module("dbos").DBOS
    emit({"peer": "dbos", "version": version_of("dbos")})
    dbos(config={"name": "keel-bench-peers", "system_database_url": dbos_system_url(dsn)})
    model = dbos.step()(answer_text)

    def turn_body(session_id: str, text: str) -> str:
        answer: str = model(text)
        return answer

    turn = dbos.workflow()(turn_body)
    dbos.launch()
    try:
        warmup = str(uuid.uuid4())
        for n in range(WARMUP_TURNS):
            turn(warmup, f"warm-up {n}")
        session_id = str(uuid.uuid4())
        latencies: list[float] = []
        started = clocks()
        for n in range(turns):
            began = time.perf_counter()
            turn(session_id, f"hello {n}")
            latencies.append(time.perf_counter() - began)
        report("dbos", "one_session", 1, started, latencies)

        concurrent: list[float] = []
        lock = threading.Lock()

        def session() -> None:
            own = str(uuid.uuid4())
            for n in range(each):
                began = time.perf_counter()
                turn(own, f"hello {n}")
                with lock:
                    concurrent.append(time.perf_counter() - began)

        threads = [threading.Thread(target=session) for _ in range(sessions)]
        started = clocks()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report("dbos", "sessions", sessions, started, concurrent)
    finally:
        dbos.destroy()


PEERS = {"langgraph": run_langgraph, "dbos": run_dbos}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=sorted(PEERS), required=True)
    parser.add_argument("--turns", type=int, default=100, help="turns of the one session")
    parser.add_argument("--sessions", type=int, default=50, help="sessions at once")
    parser.add_argument("--each", type=int, default=10, help="turns per concurrent session")
    args = parser.parse_args()
    try:
        PEERS[args.peer](os.environ[DSN_ENV], args.turns, args.sessions, args.each)
    except Exception as error:
        emit({"peer": args.peer, "error": repr(error)[:500]})
        raise SystemExit(1) from error


if __name__ == "__main__":
    main()
