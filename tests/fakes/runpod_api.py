"""A fake RunPod GraphQL API (POST /graphql), shaped after docs.runpod.io's GraphQL pages and
the runpod-python SDK's queries:

- gpuTypes(input: GpuTypeFilter) { id displayName memoryInGb securePrice communityPrice
  lowestPrice(input: GpuLowestPriceInput) { minimumBidPrice uninterruptablePrice stockStatus } }
- podFindAndDeployOnDemand(input: PodFindAndDeployOnDemandInput!) / podRentInterruptable(input:
  PodRentInterruptableInput!) -> Pod; no machine with minMemoryInGb -> the documented error
  "There are no longer any instances available with the requested specifications...".
- pod(input: PodFilter!) -> Pod or null; myself { pods { ... } }; podTerminate(input: {podId}).
- Pod { id name desiredStatus costPerHr ... runtime { uptimeInSeconds ports { ip isIpPublic
  privatePort publicPort type } } }: runtime is null for `boot_polls` reads (RUNNING while the
  image pulls), then 22/tcp points at the test sshd. env PUBLIC_KEY goes into authorized_keys,
  as RunPod's images do, and comes out again when the pod is terminated.
Only what the client asks through GraphQL variables is understood; a selected field the schema
lacks, or an input field the input type lacks, is a GraphQL error (as the real server says).
Auth: Authorization: Bearer KEY or ?api_key=KEY; else HTTP 401.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from tests.fakes.base import ApiError, FakeApi

POD_FIELDS = {
    "id",
    "name",
    "desiredStatus",
    "imageName",
    "costPerHr",
    "gpuCount",
    "memoryInGb",
    "vcpuCount",
    "containerDiskInGb",
    "volumeInGb",
    "env",
    "uptimeSeconds",
    "lastStatusChange",
    "machineId",
    "podType",
    "ports",
    "runtime",
    "uptimeInSeconds",
    "ip",
    "isIpPublic",
    "privatePort",
    "publicPort",
    "type",
    "gpus",
    "gpuUtilPercent",
    "memoryUtilPercent",
    "machine",
    "podHostId",
    "gpuDisplayName",
}
GPU_FIELDS = {
    "id",
    "displayName",
    "memoryInGb",
    "securePrice",
    "communityPrice",
    "secureSpotPrice",
    "communitySpotPrice",
    "lowestPrice",
    "minimumBidPrice",
    "uninterruptablePrice",
    "stockStatus",
    "maxGpuCount",
    "secureCloud",
    "communityCloud",
    "minMemory",
    "minVcpu",
}
ROOTS = {"podFindAndDeployOnDemand", "podRentInterruptable", "podTerminate", "pod", "myself", "pods", "gpuTypes"}
DEPLOY_INPUT = {
    "cloudType",
    "gpuCount",
    "volumeInGb",
    "containerDiskInGb",
    "minVcpuCount",
    "minMemoryInGb",
    "gpuTypeId",
    "name",
    "imageName",
    "dockerArgs",
    "ports",
    "volumeMountPath",
    "env",
    "startSsh",
    "startJupyter",
    "supportPublicIp",
    "dataCenterId",
    "countryCode",
    "templateId",
    "networkVolumeId",
    "allowedCudaVersions",
    "minDownload",
    "minUpload",
    "cudaVersion",
    "volumeKey",
}
NO_CAPACITY = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)


def gpu_type(id="NVIDIA GeForce RTX 4090", name="RTX 4090", secure=0.69, community=0.34) -> dict:
    return {
        "id": id,
        "displayName": name,
        "memoryInGb": 24,
        "securePrice": secure,
        "communityPrice": community,
        "secureSpotPrice": round(secure * 0.6, 3),
        "communitySpotPrice": round(community * 0.6, 3),
        "maxGpuCount": 8,
        "secureCloud": True,
        "communityCloud": True,
    }


@dataclass
class FakeRunPod(FakeApi):
    gpu_types: list[dict] = field(
        default_factory=lambda: [gpu_type(), gpu_type("NVIDIA RTX A6000", "RTX A6000", 0.79, 0.49)]
    )
    host_memory_gb: int = 251  # the biggest machine: minMemoryInGb above this finds none
    pods: dict[str, dict] = field(default_factory=dict)
    terminated: list[str] = field(default_factory=list)
    deploy_inputs: list[dict] = field(default_factory=list)
    boot_polls: int = 2

    def __post_init__(self):
        super().__post_init__()
        self._ids = (f"fakepod{n:06d}" for n in itertools.count(1))

    @property
    def url(self) -> str:
        return f"{self.origin}/graphql"

    def unauthorized(self) -> dict:
        return {"errors": [{"message": "Unauthorized"}]}

    def handle(self, method: str, path: str, body, query: dict) -> tuple[int, dict]:
        if method != "POST" or path != "/graphql" or not isinstance(body, dict) or "query" not in body:
            raise ApiError(400, {"errors": [{"message": "POST a JSON body with a query to /graphql"}]})
        text, variables = body["query"], body.get("variables") or {}
        try:
            self._check_fields(text)
            return 200, {"data": self._run(text, variables)}
        except GraphQLError as err:
            return 200, {"errors": [{"message": str(err), "path": [err.root] if err.root else []}], "data": None}

    # a little GraphQL ----------------------------------------------------------------------------
    def _check_fields(self, text: str) -> None:
        body = text[text.index("{") :]
        body = re.sub(r"\([^()]*\)", "", body)  # arguments
        body = re.sub(r"\b\w+\s*:\s*(?=\w)", "", body)  # aliases
        for name in re.findall(r"[A-Za-z_]\w*", body):
            if name not in POD_FIELDS | GPU_FIELDS | ROOTS:
                raise GraphQLError(f'Cannot query field "{name}".')

    def _run(self, text: str, variables: dict) -> dict:
        data: dict = {}
        arg = variables.get("input") or {}
        if "podFindAndDeployOnDemand" in text:
            data["podFindAndDeployOnDemand"] = self._deploy(arg, spot=False)
        elif "podRentInterruptable" in text:
            data["podRentInterruptable"] = self._deploy(arg, spot=True)
        elif "podTerminate" in text:
            pod = self.pods.pop(arg.get("podId"), None)
            if pod is None:
                raise GraphQLError("Pod not found", "podTerminate")
            if self.ssh:
                self.ssh.remove_key(pod["_public_key"])
            self.terminated.append(pod["id"])
            data["podTerminate"] = None
        elif re.search(r"\bpod\s*\(", text):
            pod = self.pods.get(arg.get("podId"))
            data["pod"] = self._view(pod) if pod else None
        elif "myself" in text:
            data["myself"] = {"pods": [self._view(p) for p in self.pods.values()]}
        elif "gpuTypes" in text:
            data["gpuTypes"] = self._gpu_types(text, variables)
        else:
            raise GraphQLError("unknown operation")
        return data

    def _gpu_types(self, text: str, variables: dict) -> list[dict]:
        wanted = (variables.get("gpu") or variables.get("input") or {}).get("id")
        rows = []
        for gpu in self.gpu_types:
            if wanted and gpu["id"] != wanted:
                continue
            row = dict(gpu)
            for alias, var in re.findall(r"(\w+)\s*:\s*lowestPrice\s*\(\s*input\s*:\s*\$(\w+)", text):
                row[alias] = self._lowest(gpu, variables.get(var) or {})
            rows.append(row)
        return rows

    def _lowest(self, gpu: dict, want: dict) -> dict:
        secure = want.get("secureCloud", True)
        if (want.get("minMemoryInGb") or 0) > self.host_memory_gb or (want.get("gpuCount") or 1) > gpu["maxGpuCount"]:
            return {"minimumBidPrice": None, "uninterruptablePrice": None, "stockStatus": None}
        on_demand = gpu["securePrice"] if secure else gpu["communityPrice"]
        spot = gpu["secureSpotPrice"] if secure else gpu["communitySpotPrice"]
        return {"minimumBidPrice": spot, "uninterruptablePrice": on_demand, "stockStatus": "High"}

    def _deploy(self, arg: dict, spot: bool) -> dict:
        allowed = DEPLOY_INPUT | ({"bidPerGpu"} if spot else set())
        root = "podRentInterruptable" if spot else "podFindAndDeployOnDemand"
        for name in arg:
            if name not in allowed:
                raise GraphQLError(f'Field "{name}" is not defined by type "{root[0].upper() + root[1:]}Input".', root)
        for name in ("gpuTypeId", "imageName", "cloudType") + (("bidPerGpu",) if spot else ()):
            if not arg.get(name):
                raise GraphQLError(f'Field "{name}" of required type was not provided.', root)
        if arg["cloudType"] not in ("ALL", "SECURE", "COMMUNITY"):
            raise GraphQLError(f'Value "{arg["cloudType"]}" does not exist in "CloudTypeEnum" enum.', root)
        env = arg.get("env") or []
        if not all(isinstance(e, dict) and set(e) == {"key", "value"} for e in env):
            raise GraphQLError("env must be a list of {key, value}", root)
        gpu = next((g for g in self.gpu_types if g["id"] == arg["gpuTypeId"]), None)
        if gpu is None or (arg.get("minMemoryInGb") or 0) > self.host_memory_gb:
            raise GraphQLError(NO_CAPACITY, root)
        self.deploy_inputs.append(arg)
        secure = arg["cloudType"] == "SECURE"
        per_gpu = arg["bidPerGpu"] if spot else gpu["securePrice" if secure else "communityPrice"]
        public_key = next((e["value"] for e in env if e["key"] == "PUBLIC_KEY"), "")
        pod = {
            "id": next(self._ids),
            "name": arg.get("name", ""),
            "imageName": arg["imageName"],
            "gpuCount": arg.get("gpuCount", 1),
            "costPerHr": round(per_gpu * arg.get("gpuCount", 1), 3),
            "env": [f"{e['key']}={e['value']}" for e in env],
            "ports": arg.get("ports"),
            "containerDiskInGb": arg.get("containerDiskInGb"),
            "volumeInGb": arg.get("volumeInGb"),
            "_reads": 0,
            "_public_key": public_key,
            "_gpu": gpu,
        }
        if public_key and self.ssh:
            self.ssh.add_key(public_key)
        self.pods[pod["id"]] = pod
        return self._view(pod, count=False)

    def _view(self, pod: dict, count: bool = True) -> dict:
        if count:
            pod["_reads"] += 1
        booted = pod["_reads"] > self.boot_polls and self.ssh is not None
        runtime = None
        if booted:
            runtime = {
                "uptimeInSeconds": pod["_reads"],
                "gpus": [],
                "ports": [
                    {
                        "ip": self.ssh.address,
                        "isIpPublic": True,
                        "privatePort": 22,
                        "publicPort": self.ssh.port,
                        "type": "tcp",
                    },
                    {"ip": "10.0.0.7", "isIpPublic": False, "privatePort": 22, "publicPort": 22, "type": "tcp"},
                ],
            }
        view = {k: v for k, v in pod.items() if not k.startswith("_")}
        view.update(
            desiredStatus="RUNNING",
            runtime=runtime,
            uptimeSeconds=pod["_reads"],
            machine={"podHostId": f"{pod['id']}-host", "gpuDisplayName": pod["_gpu"]["displayName"]},
        )
        return view


class GraphQLError(Exception):
    def __init__(self, message: str, root: str | None = None):
        super().__init__(message)
        self.root = root
