"""A Flask application whose views take timeouts of their own
(shmwheel.contrib.request_timeout), on a blueprint and a MethodView: under
uWSGI, ``views_flask_uwsgi:application``.

    GET /             answers at once
    GET /short?s=N    request_timeout(0.5): a blueprint's view, time.sleep(N)
    GET /long?s=N     request_timeout(60) on a MethodView
    GET /none?s=N     request_timeout(None) on a plain view
"""

from __future__ import annotations

import os
import time

from flask import Blueprint, Flask, request
from flask.views import MethodView

from shmwheel.contrib import request_timeout

app = Flask(__name__)
views = Blueprint("views", __name__)


def _sleep_then_answer() -> str:
    time.sleep(float(request.args.get("s", "0")))
    return f"done by pid {os.getpid()}\n"


@app.route("/")
def root() -> str:
    return f"done by pid {os.getpid()}\n"


@views.route("/short")
@request_timeout(0.5)
def short() -> str:
    return _sleep_then_answer()


@request_timeout(60)
class Long(MethodView):
    def get(self) -> str:
        return _sleep_then_answer()


@app.route("/none")
@request_timeout(None)
def untimed() -> str:
    return _sleep_then_answer()


app.register_blueprint(views)
app.add_url_rule("/long", view_func=Long.as_view("long"))
