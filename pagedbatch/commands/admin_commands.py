"""Operators' commands on the database: `keys create|list|revoke` and `tenants set|list` (limits, weight)."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from pagedbatch.failures import database_errors, usage_error


def _settings(args):
    from store.settings import Settings

    settings = Settings.from_env()
    if args.database_url:
        settings.database_url = args.database_url
    if not settings.database_url:
        raise usage_error("set PAGEDBATCH_DATABASE_URL or give --database-url")
    return settings


def _on_database(func):
    """An admin command: a database that cannot be reached is one line (`failures.database_errors`)."""

    @functools.wraps(func)
    def run(args) -> int:
        with database_errors(lambda: _settings(args).database_url):
            return func(args)

    return run


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _limit(value) -> str:
    return "default" if value is None else "unlimited" if value == 0 else str(value)


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a weight is a positive number, got {text!r}")
    return value


def _keys_create(args) -> int:
    from store.keys import create_key

    key, info = create_key(_settings(args), args.tenant, name=args.name)
    print(f"created {info.id} for tenant {info.tenant!r}; the key is shown only this once:", file=sys.stderr)
    print(key)
    return 0


def _key_json(k) -> dict:
    return {
        "id": k.id,
        "tenant": k.tenant,
        "prefix": k.prefix,
        "name": k.name,
        "created_at": k.created_at.isoformat(),
        "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
    }


def _keys_list(args) -> int:
    from store.keys import list_keys

    rows = list_keys(_settings(args), args.tenant)
    if args.json:
        print(json.dumps([_key_json(k) for k in rows], indent=2))
        return 0
    table = [("ID", "TENANT", "PREFIX", "CREATED", "REVOKED", "NAME")]
    table += [(k.id, k.tenant, k.prefix + "...", _when(k.created_at), _when(k.revoked_at), k.name or "") for k in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _keys_revoke(args) -> int:
    from store.keys import revoke_key

    try:
        info = revoke_key(_settings(args), args.key_id)
    except KeyError:
        raise usage_error(f"no key {args.key_id} ('pagedbatch keys list' shows them)") from None
    print(f"revoked {info.id} (tenant {info.tenant!r}, {info.prefix}...)", file=sys.stderr)
    return 0


def _tenants_set(args) -> int:
    from store.keys import set_tenant_limits

    row = set_tenant_limits(
        _settings(args),
        args.tenant,
        max_active_jobs=args.max_active_jobs,
        max_queued_requests=args.max_queued_requests,
        max_files=args.max_files,
        max_file_bytes=args.max_file_bytes,
        weight=args.weight,
    )
    print(
        f"tenant {row.name!r}: max active jobs {_limit(row.max_active_jobs)}, "
        f"max queued requests {_limit(row.max_queued_requests)}, max files {_limit(row.max_files)}, "
        f"max file bytes {_limit(row.max_file_bytes)}, weight {row.weight:g}"
    )
    return 0


def _tenants_list(args) -> int:
    from store.keys import list_tenants

    for row in list_tenants(_settings(args)):
        print(
            f"{row.name}\tmax_active_jobs={_limit(row.max_active_jobs)}\t"
            f"max_queued_requests={_limit(row.max_queued_requests)}\t"
            f"max_files={_limit(row.max_files)}\tmax_file_bytes={_limit(row.max_file_bytes)}\t"
            f"weight={row.weight:g}"
        )
    return 0


def _admin_parser(group, name: str, help: str):
    parser = group.add_parser(name, help=help)
    parser.add_argument("--database-url", default=None, help="default: $PAGEDBATCH_DATABASE_URL")
    return parser


def add_commands(commands) -> None:
    keys = commands.add_parser("keys", help="API keys: create, list, revoke")
    keys = keys.add_subparsers(dest="keys_command", required=True)
    create = _admin_parser(keys, "create", "create a key for a tenant; prints the key, once")
    create.add_argument("--tenant", default=None, help="default: the tenant named default")
    create.add_argument("--name", default=None, help="a label to tell keys apart")
    create.set_defaults(func=_on_database(_keys_create))
    listing = _admin_parser(keys, "list", "list keys (id, tenant, prefix, created, revoked; never the key)")
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_on_database(_keys_list))
    revoke = _admin_parser(keys, "revoke", "revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=_on_database(_keys_revoke))

    tenants = commands.add_parser("tenants", help="tenants' limits and fair-share weights")
    tenants = tenants.add_subparsers(dest="tenants_command", required=True)
    limits = _admin_parser(tenants, "set", "set a tenant's limits (0: unlimited; omitted: the server's default)")
    limits.add_argument("tenant")
    limits.add_argument("--max-active-jobs", type=int, default=None)
    limits.add_argument("--max-queued-requests", type=int, default=None)
    limits.add_argument("--max-files", type=int, default=None, help="uploaded files kept at once")
    limits.add_argument("--max-file-bytes", type=int, default=None, help="bytes of uploaded files kept at once")
    limits.add_argument(
        "--weight",
        type=_weight,
        default=None,
        help="its share of a worker's engine beside other tenants' (default 1; omitted: unchanged)",
    )
    limits.set_defaults(func=_on_database(_tenants_set))
    listing = _admin_parser(tenants, "list", "list tenants, their limits and weights")
    listing.set_defaults(func=_on_database(_tenants_list))
