"""The node's self-teardown through a vendor's HTTP API (vast, runpod): the calls that delete the
cluster's own instances, run on the node itself when the run ends or the budget cap comes, so
the machine goes away with the laptop closed. AWS ends its nodes otherwise (providers/aws.py)."""

from __future__ import annotations

from provision.core.state import ClusterRecord
from provision.providers.base import SelfTeardown

# The node-side teardown: HTTP calls with python3's urllib (present in any image that trains),
# the key from $GPUCTL_TEARDOWN_KEY (secrets.env), never argv. argv: METHOD then URL BODY pairs,
# the node running it last. 404 or "not found" counts as done; 429/5xx, GraphQL errors and
# network errors (and Vast's {"success": false}) are retried with backoff for about ten minutes.
TEARDOWN_PY = """\
import json, os, sys, time, urllib.error, urllib.request
method, calls = sys.argv[1], list(zip(sys.argv[2::2], sys.argv[3::2]))
headers = {"Authorization": "Bearer " + os.environ["GPUCTL_TEARDOWN_KEY"], "Content-Type": "application/json"}
def call(url, body):
    for attempt in range(12):
        try:
            req = urllib.request.Request(url, body.encode() or None, headers, method=method)
            answer = urllib.request.urlopen(req, timeout=30).read()
            doc = json.loads(answer) if answer.strip() else {}
            errors = doc.get("errors") if isinstance(doc, dict) else None
            if isinstance(doc, dict) and doc.get("success") is False:  # Vast refuses with HTTP 200
                errors = doc.get("msg") or doc.get("error") or "success: false"
            if not errors or "not found" in str(errors).lower():
                print("gpuctl: self-teardown accepted:", url.rsplit("/", 2)[-2] if not body else body[-40:])
                return True
            print("gpuctl: self-teardown retrying:", str(errors)[:200])
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return True
            if err.code != 429 and err.code < 500:
                print("gpuctl: self-teardown refused: HTTP", err.code)
                return False
            print("gpuctl: self-teardown retrying: HTTP", err.code)
        except (OSError, ValueError) as err:
            print("gpuctl: self-teardown retrying:", type(err).__name__)
        time.sleep(min(60, 2 ** attempt))
    return False
sys.exit(0 if all([call(url, body) for url, body in calls]) else 1)
"""


def http_teardown(python: str, method: str, calls: list[tuple[str, str]], key: str) -> SelfTeardown:
    """The node's self-teardown as HTTP calls (url, body), in order; the key travels in env."""
    argv = [python, "-c", TEARDOWN_PY, method]
    for url, body in calls:
        argv += [url, body]
    return SelfTeardown(argv=argv, env={"GPUCTL_TEARDOWN_KEY": key})


def node_last(cluster: ClusterRecord) -> list[str]:
    """Instance ids with the first node (the one that runs launch.sh) last, so it ends itself last."""
    ids = [n.instance_id for n in cluster.nodes if n.instance_id]
    return ids[1:] + ids[:1]
