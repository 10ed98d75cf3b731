#!/usr/bin/env python3
"""Reads messages as the relay's consumers received them and turns each into a
CloudEvent with the CloudEvents Python SDK (PyPI `cloudevents`, its AMQP protocol
binding in binary content mode), which validates the event; prints what the SDK
made of it. Used by tests/delivery/cloudevents.rs (docs/cloudevents.md, "How it is tested").

stdin: a JSON array of messages, each
    {"content_type": "...", "properties": {"<header or application property>": value},
     "body_hex": "..."}
stdout: a JSON array, one object per message, in order: either
    {"ok": true, "attributes": {...}, "time_micros": N, "extensions": {...},
     "data_hex": "...", "data_json": ...}
or  {"ok": false, "error": "..."} when the SDK refuses the message.

The AMQP 0-9-1 headers of an exchange's message and the AMQP 1.0 application
properties of a stream's message are both given as `properties`: the SDK's AMQP
binding reads the `cloudEvents:`-prefixed ones as the attributes and the message's
content-type as `datacontenttype`. The SDK is installed for the user (pinned) when
it is missing, so the script installs what it needs on a fresh machine.
"""

import importlib
import json
import os
import subprocess
import sys

SDK = "cloudevents==2.2.0"


def ensure_sdk():
    try:
        importlib.import_module("cloudevents.core.bindings.amqp")
        return
    except ImportError:
        pass
    if os.environ.get("CE_CONSUMER_INSTALLED"):
        sys.exit(f"the CloudEvents SDK ({SDK}) is still not importable after installing it")
    base = [sys.executable, "-m", "pip", "install", "--user", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(base + [SDK], stdout=sys.stderr, stderr=sys.stderr)
    if done.returncode != 0:
        # Debian's Python refuses --user installs unless told otherwise (PEP 668).
        done = subprocess.run(base + ["--break-system-packages", SDK], stdout=sys.stderr, stderr=sys.stderr)
    if done.returncode != 0:
        sys.exit(f"cannot install {SDK} with pip: install it by hand (pip install --user {SDK})")
    # A user site directory created just now is not on this interpreter's path: start
    # again (stdin has not been read yet).
    os.environ["CE_CONSUMER_INSTALLED"] = "1"
    os.execv(sys.executable, [sys.executable] + sys.argv)


ensure_sdk()

from datetime import datetime, timezone  # noqa: E402

from cloudevents.core.bindings import amqp  # noqa: E402
from cloudevents.core.formats.json import JSONFormat  # noqa: E402
from cloudevents.core.v1.event import CloudEvent  # noqa: E402

STANDARD = {"id", "source", "type", "specversion", "time", "subject", "datacontenttype", "dataschema"}
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class RawFormat(JSONFormat):
    """JSON format whose data is the body's bytes as they are (to compare them exactly)."""

    def read_data(self, body, datacontenttype):
        return bytes(body) if body else None


def convert(m):
    message = amqp.AMQPMessage(
        properties={"content-type": m["content_type"]} if m.get("content_type") is not None else {},
        application_properties=m["properties"],
        application_data=bytes.fromhex(m["body_hex"]),
    )
    raw = amqp.from_binary(message, RawFormat(), CloudEvent)
    parsed = amqp.from_binary(message, JSONFormat(), CloudEvent)
    attributes = raw.get_attributes()
    time = attributes.get("time")
    out = {k: v for k, v in attributes.items() if k in STANDARD}
    if isinstance(time, datetime):
        out["time"] = time.isoformat()
        delta = time - EPOCH
        micros = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    else:
        micros = None
    data = raw.get_data()
    return {
        "ok": True,
        "attributes": out,
        "time_micros": micros,
        "extensions": {k: v for k, v in attributes.items() if k not in STANDARD},
        "data_hex": data.hex() if isinstance(data, (bytes, bytearray)) else None,
        "data_json": parsed.get_data() if not isinstance(parsed.get_data(), bytes) else None,
    }


def main():
    results = []
    for m in json.load(sys.stdin):
        try:
            results.append(convert(m))
        except Exception as e:  # the SDK's validation errors, reported per message
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
