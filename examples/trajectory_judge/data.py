"""Deterministic generator of trajectory-judge examples (stdlib only).

Each example is a dict::

    {"id", "task", "a": {"trace", "output", "receipts"}, "b": {...},
     "better": "A" | "B", "reason": str, "kind": str}

The decisive signal is always in the *receipts* (evidence such as test results,
exit codes, command logs): the better attempt has a receipt that shows the
relevant command succeeding; the worse one has a receipt that shows failure,
or no receipt at all. Outputs are deliberately misleading in the hard kinds.

Kinds:
  pass_vs_fail       both outputs neutral; one receipt passes, the other fails.
  polish_vs_correct  (hard) worse attempt: long, polished, confident output but a
                     failing receipt; better attempt: terse output, passing receipt.
  claim_no_receipt   (hard) worse attempt claims success ("all tests pass") but has
                     no receipt; better attempt has a real passing receipt.
  polished_correct   (train-only counter-case) the polished/long attempt is the
                     better one (passing receipt) and the terse one fails, so
                     "long output = worse" is not a usable shortcut.
  both_claim         (train-only counter-case) both outputs claim success; only one
                     backs it with a passing receipt, the other has none, so
                     "claims success = worse" is not a usable shortcut.

Held-out examples use task objects (files, tables, services, ...) that never
appear in training, so every held-out task text is unseen. A/B is balanced
exactly within every kind of each split.

Regenerate the committed files from the repo root with::

    python -m examples.trajectory_judge.data
"""

from __future__ import annotations

import json
import os
import random

SEED = 20240611

# Number of examples per kind in each split (all even, so A/B balances exactly).
TRAIN_COUNTS = {
    "pass_vs_fail": 40,
    "polish_vs_correct": 40,
    "claim_no_receipt": 40,
    "polished_correct": 20,
    "both_claim": 20,
}
HELDOUT_COUNTS = {
    "pass_vs_fail": 12,
    "polish_vs_correct": 18,
    "claim_no_receipt": 18,
}
HARD_KINDS = ("polish_vs_correct", "claim_no_receipt")

# ---------------------------------------------------------------------------
# Domains. Each object is a dict of slots used by the domain's templates.
# The last HELDOUT_OBJECTS objects of each domain are reserved for held-out.
# ---------------------------------------------------------------------------
HELDOUT_OBJECTS = 3

DOMAINS = [
    {
        "name": "bugfix",
        "tasks": [
            "Fix the {bug} in {path}.",
            "Resolve the {bug} reported in {path}.",
            "{path} has a {bug}; fix it.",
        ],
        "objects": [
            {"bug": "timezone bug", "path": "billing/invoice.py", "fn": "to_utc", "tst": "tests/test_invoice.py"},
            {"bug": "off-by-one error", "path": "utils/paginate.py", "fn": "page_slice", "tst": "tests/test_paginate.py"},
            {"bug": "null pointer crash", "path": "api/users.py", "fn": "get_profile", "tst": "tests/test_users.py"},
            {"bug": "race condition", "path": "cache/lru.py", "fn": "evict", "tst": "tests/test_lru.py"},
            {"bug": "rounding error", "path": "cart/totals.py", "fn": "subtotal", "tst": "tests/test_totals.py"},
            {"bug": "unicode decode error", "path": "io/reader.py", "fn": "read_lines", "tst": "tests/test_reader.py"},
            {"bug": "memory leak", "path": "ws/session.py", "fn": "close", "tst": "tests/test_session.py"},
            {"bug": "wrong sort order", "path": "search/rank.py", "fn": "score", "tst": "tests/test_rank.py"},
            {"bug": "date parsing bug", "path": "core/dates.py", "fn": "parse_date", "tst": "tests/test_dates.py"},
            {"bug": "retry loop bug", "path": "net/client.py", "fn": "send", "tst": "tests/test_client.py"},
            {"bug": "config merge bug", "path": "conf/loader.py", "fn": "merge", "tst": "tests/test_loader.py"},
            {"bug": "auth header bug", "path": "auth/token.py", "fn": "sign", "tst": "tests/test_token.py"},
            {"bug": "CSV quoting bug", "path": "export/csv_out.py", "fn": "write_row", "tst": "tests/test_csv_out.py"},
        ],
        "trace": [
            "edited {fn}(); ran tests",
            "patched {path}; ran {tst}",
            "rewrote {fn}(); reran tests",
        ],
        "trace_norun": [
            "read {path}; edited {fn}()",
            "opened {path}; patched {fn}()",
        ],
        "cmds": ["pytest -q {tst}", "pytest {tst}", "python -m pytest -q"],
        "ok": ["{n} passed", "{n} passed in 0.{d}s", "OK ({n} tests)"],
        "fail": ["{k} failed, {n} passed", "FAILED {tst}::test_{fn}", "{k} failed: AssertionError"],
        "fail_codes": [1],
        "terse": ["Patched {fn}().", "Fixed {fn}() in {path}.", "Changed {fn}() to handle the edge case."],
        "claim": ["Fixed {fn}(); all tests pass.", "Done, the {bug} is fixed and tests are green."],
        "ok_what": "tests passing",
        "fail_what": "tests failing",
    },
    {
        "name": "data",
        "tasks": [
            "Load {src} into the {table} table.",
            "Run the nightly job that builds {table} from {src}.",
            "Backfill {table} from {src}.",
        ],
        "objects": [
            {"src": "orders.csv", "table": "orders", "script": "etl_orders.py"},
            {"src": "events.parquet", "table": "events_daily", "script": "build_events.py"},
            {"src": "users.json", "table": "dim_users", "script": "load_users.py"},
            {"src": "payments.csv", "table": "payments", "script": "etl_payments.py"},
            {"src": "clicks.parquet", "table": "click_stats", "script": "agg_clicks.py"},
            {"src": "inventory.csv", "table": "stock_levels", "script": "load_stock.py"},
            {"src": "logs.jsonl", "table": "error_counts", "script": "count_errors.py"},
            {"src": "reviews.csv", "table": "review_scores", "script": "score_reviews.py"},
            {"src": "trips.parquet", "table": "trip_facts", "script": "build_trips.py"},
            {"src": "refunds.csv", "table": "refunds", "script": "etl_refunds.py"},
            {"src": "signups.json", "table": "signup_funnel", "script": "funnel.py"},
            {"src": "ads.parquet", "table": "ad_spend", "script": "load_ads.py"},
            {"src": "tickets.csv", "table": "support_tickets", "script": "load_tickets.py"},
        ],
        "trace": [
            "fixed schema in {script}; ran job",
            "mapped columns; ran {script}",
            "edited {script}; executed it",
        ],
        "trace_norun": [
            "inspected {src}; edited {script}",
            "read {script}; mapped columns",
        ],
        "cmds": ["python {script}", "python {script} --date 2024-06-01", "make load-{table}"],
        "ok": ["wrote {n}{d}0 rows", "loaded {n}{d}00 rows into {table}", "done, {n}{d}0 rows"],
        "fail": ["KeyError: 'user_id'", "schema mismatch on {table}", "0 rows written, ValueError"],
        "fail_codes": [1, 2],
        "terse": ["Updated {script}.", "Mapped the columns in {script}.", "Fixed the schema in {script}."],
        "claim": ["The job ran and {table} is fully loaded.", "All rows loaded into {table} successfully."],
        "ok_what": "the job writing rows",
        "fail_what": "the job erroring",
    },
    {
        "name": "deploy",
        "tasks": [
            "Deploy {svc} version {ver} to {env}.",
            "Roll out {svc} {ver} on {env}.",
            "Ship {svc} {ver} to the {env} cluster.",
        ],
        "objects": [
            {"svc": "checkout-api", "ver": "2.4.1", "env": "staging"},
            {"svc": "auth-service", "ver": "1.9.0", "env": "prod"},
            {"svc": "search-web", "ver": "3.0.2", "env": "staging"},
            {"svc": "billing-worker", "ver": "0.8.5", "env": "prod"},
            {"svc": "notify-svc", "ver": "5.1.0", "env": "canary"},
            {"svc": "image-resizer", "ver": "1.2.7", "env": "staging"},
            {"svc": "gateway", "ver": "4.3.3", "env": "prod"},
            {"svc": "reports-api", "ver": "2.0.0", "env": "canary"},
            {"svc": "feed-ranker", "ver": "0.9.1", "env": "staging"},
            {"svc": "geo-lookup", "ver": "1.5.4", "env": "prod"},
            {"svc": "chat-relay", "ver": "2.2.0", "env": "staging"},
            {"svc": "audit-log", "ver": "3.1.6", "env": "prod"},
            {"svc": "pricing-svc", "ver": "1.0.3", "env": "canary"},
        ],
        "trace": [
            "applied manifest; checked rollout",
            "kubectl apply; waited for rollout",
            "helm upgrade {svc}; probed health",
        ],
        "trace_norun": [
            "bumped image to {ver}; applied manifest",
            "updated helm values for {svc}",
        ],
        "cmds": ["kubectl rollout status deploy/{svc}", "curl -s {svc}.{env}/health", "helm status {svc}"],
        "ok": ["successfully rolled out", "200 OK", "deployed, {n}/{n} pods ready"],
        "fail": ["deadline exceeded, 0/{n} ready", "503 Service Unavailable", "CrashLoopBackOff"],
        "fail_codes": [1, 22],
        "terse": ["Applied {ver} to {env}.", "Upgraded {svc}.", "Rolled {svc} to {ver}."],
        "claim": ["{svc} {ver} deployed successfully to {env}.", "Deployed; {svc} is live and healthy."],
        "ok_what": "a healthy rollout",
        "fail_what": "a failed rollout",
    },
    {
        "name": "docs",
        "tasks": [
            "Update the {page} docs page and keep the site build clean.",
            "Document {feature} in {page}.",
            "Fix broken links in {page}.",
        ],
        "objects": [
            {"page": "install.md", "feature": "offline install"},
            {"page": "api/auth.md", "feature": "token refresh"},
            {"page": "quickstart.md", "feature": "the CLI login flow"},
            {"page": "config.md", "feature": "env overrides"},
            {"page": "faq.md", "feature": "proxy settings"},
            {"page": "guides/backup.md", "feature": "incremental backups"},
            {"page": "api/webhooks.md", "feature": "webhook retries"},
            {"page": "upgrade.md", "feature": "the v3 migration"},
            {"page": "security.md", "feature": "key rotation"},
            {"page": "cli.md", "feature": "the --dry-run flag"},
            {"page": "limits.md", "feature": "rate limits"},
            {"page": "sdk/python.md", "feature": "async clients"},
            {"page": "glossary.md", "feature": "workspace roles"},
        ],
        "trace": [
            "added examples; built site",
            "rewrote section in {page}; ran docs build",
            "fixed links in {page}; ran link check",
        ],
        "trace_norun": [
            "edited {page}; added examples",
            "rewrote section in {page}",
        ],
        "cmds": ["mkdocs build --strict", "make docs", "lychee docs/{page}"],
        "ok": ["built in {d}.{n}s", "0 warnings", "{n}{d} links OK"],
        "fail": ["{k} broken links", "WARNING: {page} not found", "build aborted, {k} warnings"],
        "fail_codes": [1, 2],
        "terse": ["Edited {page}.", "Added a section on {feature}.", "Updated {page}."],
        "claim": ["Docs updated and the site builds cleanly.", "{page} is done; no broken links."],
        "ok_what": "a clean docs build",
        "fail_what": "a broken docs build",
    },
    {
        "name": "script",
        "tasks": [
            "Write a script that {job}.",
            "Make sure {script} {job}.",
            "Fix {script} so it {job}.",
        ],
        "objects": [
            {"job": "backs up /etc nightly", "script": "backup.sh"},
            {"job": "rotates old log files", "script": "rotate_logs.sh"},
            {"job": "renames photos by date", "script": "rename.py"},
            {"job": "cleans stale docker images", "script": "prune.sh"},
            {"job": "syncs assets to the bucket", "script": "sync_assets.sh"},
            {"job": "checks disk usage and alerts", "script": "disk_alert.py"},
            {"job": "exports the DB to gzip", "script": "dump_db.sh"},
            {"job": "resizes uploaded images", "script": "resize.py"},
            {"job": "archives closed tickets", "script": "archive.py"},
            {"job": "renews TLS certificates", "script": "renew_certs.sh"},
            {"job": "deduplicates the mailing list", "script": "dedupe.py"},
            {"job": "mirrors the wiki to disk", "script": "mirror_wiki.sh"},
            {"job": "purges expired sessions", "script": "purge.py"},
        ],
        "trace": [
            "chmod +x; ran it",
            "added error handling; executed it",
            "fixed paths; ran a test invocation",
        ],
        "trace_norun": [
            "wrote {script}; chmod +x",
            "edited {script}; fixed paths",
        ],
        "cmds": ["./{script}", "bash -x {script}", "python {script} --once"],
        "ok": ["processed {n}{d} files", "done in {d}.{n}s", "completed, {n} items"],
        "fail": ["permission denied", "No such file or directory", "Traceback: TypeError"],
        "fail_codes": [1, 126, 127],
        "terse": ["Wrote {script}.", "Fixed paths in {script}.", "Updated {script}."],
        "claim": ["{script} works and {job}.", "Script finished successfully."],
        "ok_what": "the script completing",
        "fail_what": "the script crashing",
    },
    {
        "name": "build",
        "tasks": [
            "Get the {target} build green after the {dep} upgrade.",
            "Fix the failing {target} build.",
            "Upgrade {dep} and make sure {target} still builds.",
        ],
        "objects": [
            {"target": "android", "dep": "gradle"},
            {"target": "web bundle", "dep": "webpack"},
            {"target": "rust workspace", "dep": "tokio"},
            {"target": "go service", "dep": "grpc"},
            {"target": "docs site", "dep": "sphinx"},
            {"target": "iOS app", "dep": "cocoapods"},
            {"target": "CLI", "dep": "clap"},
            {"target": "C++ engine", "dep": "cmake"},
            {"target": "wheel", "dep": "setuptools"},
            {"target": "desktop app", "dep": "electron"},
            {"target": "lambda package", "dep": "boto3"},
            {"target": "firmware", "dep": "zephyr"},
            {"target": "admin panel", "dep": "react"},
        ],
        "trace": [
            "fixed imports; ran build",
            "pinned {dep}; rebuilt",
            "patched config; ran make",
        ],
        "trace_norun": [
            "bumped {dep}; fixed imports",
            "updated lockfile; patched config",
        ],
        "cmds": ["make build", "ci/build.sh", "make all"],
        "ok": ["build succeeded", "BUILD SUCCESSFUL in {n}{d}s", "ok, 0 errors"],
        "fail": ["{k} errors, build failed", "undefined reference, Error 2", "BUILD FAILED"],
        "fail_codes": [1, 2],
        "terse": ["Bumped {dep}.", "Pinned {dep} and fixed imports.", "Patched the build config."],
        "claim": ["The {target} build is green now.", "Upgraded {dep}; the build passes."],
        "ok_what": "a successful build",
        "fail_what": "a failed build",
    },
]

POLISHED = [
    "I carefully fixed this with a robust, clean solution. Everything is production-ready!",
    "Great news: done! I handled every edge case and it works perfectly end to end.",
    "Fully resolved with a well-structured fix following best practices. Ready to merge.",
    "Done! A comprehensive, elegant fix; I verified nothing else is affected.",
    "Completely solved. This change significantly improves reliability going forward.",
]

EXIT_FMT = "exit {c}"
NO_RECEIPT = ["none", "(none)", "no commands run", "-"]

REASONS = {
    "pass_vs_fail": [
        "{W}'s receipt shows {ok_what}; {L}'s shows {fail_what}.",
        "Only {W}'s run exited 0; {L}'s failed.",
    ],
    "polish_vs_correct": [
        "{L} sounds confident, but its receipt shows {fail_what}.",
        "{W}'s run succeeded; {L}'s polished claim is contradicted by a failure.",
    ],
    "claim_no_receipt": [
        "{L} claims success with no receipt; {W}'s shows {ok_what}.",
        "{W} has a passing receipt; {L} offers no evidence.",
    ],
    "polished_correct": [
        "{W}'s receipt shows {ok_what}; {L}'s shows {fail_what}.",
        "Only {W}'s run exited 0; {L}'s failed.",
    ],
    "both_claim": [
        "Both claim success, but only {W} has a receipt showing it.",
        "{W} has a passing receipt; {L} offers no evidence.",
    ],
}


def _fill(rng: random.Random, template: str, obj: dict) -> str:
    slots = dict(obj)
    slots.setdefault("n", rng.randint(3, 9))
    slots.setdefault("d", rng.randint(1, 9))
    slots.setdefault("k", rng.randint(1, 4))
    return template.format(**slots)


def _receipt(rng: random.Random, dom: dict, obj: dict, ok: bool) -> str:
    cmd = _fill(rng, rng.choice(dom["cmds"]), obj)
    if ok:
        res, code = _fill(rng, rng.choice(dom["ok"]), obj), 0
    else:
        res, code = _fill(rng, rng.choice(dom["fail"]), obj), rng.choice(dom["fail_codes"])
    # Uniform, decisive format: the exit status comes first, then the command log.
    return f"{EXIT_FMT.format(c=code)} | {cmd}: {res}"


def _attempt(rng, dom, obj, *, output: str, receipt: str | None) -> dict:
    if receipt is None:
        # Sometimes the trace even *says* it ran things, but there is no receipt.
        trace_t = rng.choice(dom["trace"] if rng.random() < 0.4 else dom["trace_norun"])
        return {"trace": _fill(rng, trace_t, obj), "output": output, "receipts": rng.choice(NO_RECEIPT)}
    return {"trace": _fill(rng, rng.choice(dom["trace"]), obj), "output": output, "receipts": receipt}


def make_example(rng: random.Random, kind: str, dom: dict, obj: dict, better: str, ex_id: str) -> dict:
    task = _fill(rng, rng.choice(dom["tasks"]), obj)
    terse = lambda: _fill(rng, rng.choice(dom["terse"]), obj)  # noqa: E731
    claim = lambda: _fill(rng, rng.choice(dom["claim"]), obj)  # noqa: E731
    ok_r = lambda: _receipt(rng, dom, obj, True)  # noqa: E731
    fail_r = lambda: _receipt(rng, dom, obj, False)  # noqa: E731

    if kind == "pass_vs_fail":
        good = _attempt(rng, dom, obj, output=terse(), receipt=ok_r())
        bad = _attempt(rng, dom, obj, output=terse(), receipt=fail_r())
    elif kind == "polish_vs_correct":
        good = _attempt(rng, dom, obj, output=terse(), receipt=ok_r())
        bad = _attempt(rng, dom, obj, output=rng.choice(POLISHED), receipt=fail_r())
    elif kind == "claim_no_receipt":
        good = _attempt(rng, dom, obj, output=terse(), receipt=ok_r())
        bad = _attempt(rng, dom, obj, output=claim(), receipt=None)
    elif kind == "polished_correct":
        good = _attempt(rng, dom, obj, output=rng.choice(POLISHED), receipt=ok_r())
        bad = _attempt(rng, dom, obj, output=terse(), receipt=fail_r())
    elif kind == "both_claim":
        good = _attempt(rng, dom, obj, output=claim(), receipt=ok_r())
        bad = _attempt(rng, dom, obj, output=claim(), receipt=None)
    else:
        raise ValueError(kind)

    worse = "B" if better == "A" else "A"
    a, b = (good, bad) if better == "A" else (bad, good)
    reason = rng.choice(REASONS[kind]).format(
        W=better, L=worse, ok_what=dom["ok_what"], fail_what=dom["fail_what"]
    )
    return {"id": ex_id, "task": task, "a": a, "b": b, "better": better, "reason": reason, "kind": kind}


def _objects(heldout: bool) -> list[tuple[dict, dict]]:
    out = []
    for dom in DOMAINS:
        objs = dom["objects"][-HELDOUT_OBJECTS:] if heldout else dom["objects"][:-HELDOUT_OBJECTS]
        out.extend((dom, o) for o in objs)
    return out


def generate_split(rng: random.Random, counts: dict[str, int], heldout: bool) -> list[dict]:
    pool = _objects(heldout)
    prefix = "heldout" if heldout else "train"
    examples = []
    seen_tasks: set[str] = set()
    for kind, n in counts.items():
        assert n % 2 == 0, "counts must be even for an exact A/B balance"
        sides = ["A"] * (n // 2) + ["B"] * (n // 2)
        rng.shuffle(sides)
        for better in sides:
            # Held-out: avoid repeating a task text within the split when possible.
            for _ in range(20):
                dom, obj = rng.choice(pool)
                ex = make_example(rng, kind, dom, obj, better, "")
                if not heldout or ex["task"] not in seen_tasks:
                    break
            seen_tasks.add(ex["task"])
            examples.append(ex)
    rng.shuffle(examples)
    for i, ex in enumerate(examples):
        ex["id"] = f"{prefix}-{i:04d}"
    return examples


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    train = generate_split(rng, TRAIN_COUNTS, heldout=False)
    heldout = generate_split(rng, HELDOUT_COUNTS, heldout=True)
    train_tasks = {ex["task"] for ex in train}
    assert not any(ex["task"] in train_tasks for ex in heldout), "held-out task leaked into train"
    return train, heldout


def write_jsonl(path: str, examples: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_PATH = os.path.join(HERE, "train.jsonl")
HELDOUT_PATH = os.path.join(HERE, "heldout.jsonl")


def load_train() -> list[dict]:
    return read_jsonl(TRAIN_PATH)


def load_heldout() -> list[dict]:
    return read_jsonl(HELDOUT_PATH)


def _summary(name: str, examples: list[dict]) -> str:
    kinds: dict[str, int] = {}
    for ex in examples:
        kinds[ex["kind"]] = kinds.get(ex["kind"], 0) + 1
    n_a = sum(ex["better"] == "A" for ex in examples)
    hard = sum(ex["kind"] in HARD_KINDS for ex in examples)
    return f"{name}: {len(examples)} examples, better=A {n_a} / B {len(examples) - n_a}, hard {hard}, kinds {kinds}"


def main() -> None:
    train, heldout = generate()
    write_jsonl(TRAIN_PATH, train)
    write_jsonl(HELDOUT_PATH, heldout)
    print(_summary("train", train))
    print(_summary("heldout", heldout))


if __name__ == "__main__":
    main()
