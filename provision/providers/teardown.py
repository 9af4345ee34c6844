"""The node's self-teardown through a vendor's HTTP API (vast, runpod): the calls that delete the
cluster's own instances, run on the node itself when the run ends or the budget cap comes, so
the machine goes away with the laptop closed. AWS ends its nodes otherwise (providers/aws.py)."""

from __future__ import annotations

from provision.core.state import ClusterRecord
from provision.providers.base import SelfTeardown

# The node-side script: HTTP calls with python3's urllib (present in any image that trains), the
# key from $GPUCTL_TEARDOWN_KEY (guard.env / secrets.env), never argv. argv: MODE METHOD, then the
# calls. MODE teardown: URL BODY pairs, the node running it last; 404 or "not found" counts as
# done; 429/5xx, GraphQL errors and network errors (and Vast's {"success": false}) are retried
# with backoff for about ten minutes. MODE check (`up` runs it at once, flows/guard.py): URL BODY
# ID triples of read-only calls that must show instance ID with this key from this node; a few
# quick tries, then exit 1 with the reason on one line. A redirect is followed only within the
# API's origin: urllib's default handler would send the key to wherever a 30x points.
TEARDOWN_PY = """\
import json, os, sys, time, urllib.error, urllib.parse, urllib.request
mode, method = sys.argv[1], sys.argv[2]
step = 3 if mode == "check" else 2
calls = [sys.argv[i:i + step] for i in range(3, len(sys.argv), step)]
who = "teardown check" if mode == "check" else "self-teardown"
headers = {"Authorization": "Bearer " + os.environ["GPUCTL_TEARDOWN_KEY"], "Content-Type": "application/json"}
def origin(url):
    p = urllib.parse.urlsplit(url)
    return p.scheme, (p.hostname or "").lower(), p.port or {"http": 80, "https": 443}.get(p.scheme)
class OffOrigin(Exception):
    pass
class SameOrigin(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, hdrs, newurl):
        if origin(newurl) != origin(req.full_url):
            fp.close()
            raise OffOrigin(newurl)
        return super().redirect_request(req, fp, code, msg, hdrs, newurl)
opener = urllib.request.build_opener(SameOrigin)
def shows(doc, want):
    if isinstance(doc, dict):
        return str(doc.get("id")) == want or any(shows(v, want) for v in doc.values())
    return isinstance(doc, list) and any(shows(v, want) for v in doc)
def call(url, body, want=None):
    for attempt in range(12 if want is None else 3):
        try:
            req = urllib.request.Request(url, body.encode() or None, headers, method=method)
            answer = opener.open(req, timeout=30 if want is None else 15).read()
            doc = json.loads(answer) if answer.strip() else {}
            errors = doc.get("errors") if isinstance(doc, dict) else None
            if isinstance(doc, dict) and doc.get("success") is False:  # Vast refuses with HTTP 200
                errors = doc.get("msg") or doc.get("error") or "success: false"
            if want is not None:
                if not errors and shows(doc, want):
                    print("gpuctl: teardown check passed: the key sees instance", want)
                    return True
                print("gpuctl: teardown check failed: the API does not show instance", want, "to this key:", str(errors or "")[:200])
                return False
            if not errors or "not found" in str(errors).lower():
                print("gpuctl: self-teardown accepted:", url.rsplit("/", 2)[-2] if not body else body[-40:])
                return True
            print("gpuctl: self-teardown retrying:", str(errors)[:200])
        except OffOrigin as off:
            print("gpuctl: %s refused: the API redirected to another origin (%s://%s:%s); the key is not sent there" % (who, *origin(str(off))))
            return False
        except urllib.error.HTTPError as err:
            if err.code == 404 and want is None:
                return True
            if err.code != 429 and err.code < 500:
                print("gpuctl: %s refused: HTTP %s" % (who, err.code))
                return False
            print("gpuctl: %s retrying: HTTP %s" % (who, err.code))
        except (OSError, ValueError) as err:
            print("gpuctl: %s retrying: %s" % (who, type(err).__name__))
        time.sleep(min(60, 2 ** attempt))
    print("gpuctl: %s failed: %s gave no answer" % (who, url.split("?")[0]))
    return False
sys.exit(0 if all([call(*c) for c in calls]) else 1)
"""


def http_teardown(
    python: str,
    method: str,
    calls: list[tuple[str, str]],
    key: str,
    *,
    check_method: str,
    checks: list[tuple[str, str, str]],
) -> SelfTeardown:
    """The node's self-teardown as HTTP calls (url, body), in order; the key travels in env.
    `checks`: read-only calls (url, body, instance id) that prove the key and endpoint work."""
    argv = [python, "-c", TEARDOWN_PY, "teardown", method]
    for url, body in calls:
        argv += [url, body]
    check = [python, "-c", TEARDOWN_PY, "check", check_method]
    for url, body, want in checks:
        check += [url, body, want]
    return SelfTeardown(argv=argv, env={"GPUCTL_TEARDOWN_KEY": key}, check=check)


def node_last(cluster: ClusterRecord) -> list[str]:
    """Instance ids with the first node (the one that runs launch.sh) last, so it ends itself last."""
    ids = [n.instance_id for n in cluster.nodes if n.instance_id]
    return ids[1:] + ids[:1]
