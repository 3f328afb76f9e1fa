"""A Flask app that reports to Sentry, with shmwheel's integration: under
Gunicorn, ``sentry_flask:app``, with the DSN in ``SENTRY_DSN``.

    GET /              answers at once
    GET /report/N?s=S  time.sleep(S): a C call, which no interrupt ends
"""

from __future__ import annotations

import os
import time

import sentry_sdk
from flask import Flask, request
from sentry_sdk.integrations.flask import FlaskIntegration

from shmwheel.contrib.sentry import ShmwheelIntegration

sentry_sdk.init(dsn=os.environ["SENTRY_DSN"], integrations=[FlaskIntegration(), ShmwheelIntegration()])

app = Flask(__name__)


@app.route("/")
def root() -> str:
    return f"done by pid {os.getpid()}\n"


@app.route("/report/<int:number>")
def report(number: int) -> str:
    time.sleep(float(request.args.get("s", "0")))
    return f"done by pid {os.getpid()}\n"
