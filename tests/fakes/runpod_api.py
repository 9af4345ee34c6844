"""A fake RunPod GraphQL API (POST /graphql) that runs a real GraphQL server (graphql-core) over
a schema written from RunPod's GraphQL spec and what the official client (PyPI `runpod`,
runpod/api/{queries,mutations}/*.py) selects, so gpuctl's queries (values in variables) and the
client's (values pasted inline) are parsed, validated and executed alike:

- a field the schema lacks, an unknown input field, a missing required one or a wrong type is
  a GraphQL validation error -> HTTP 400 {"errors": [...]} (as Apollo answers);
- gpuTypes(input: GpuTypeFilter) { ... lowestPrice(input: GpuLowestPriceInput) {...} }: prices
  per GPU (uninterruptablePrice = the cloud's price of one GPU); no host with minMemoryInGb or
  more than maxGpuCount GPUs -> all null;
- podFindAndDeployOnDemand / podRentInterruptable (bidPerGpu required) -> Pod; no machine with
  minMemoryInGb -> the documented "There are no longer any instances available..." error;
  costPerHr = per-GPU price x gpuCount (what the pod is billed); the machines' driver CUDA
  (`host_cuda`) not in allowedCudaVersions, or their uplink (`host_upload_mbps`) below minUpload:
  the same error;
- pod(input: PodFilter) -> Pod or null; myself { pods }; podTerminate(input) -> Void ("pod not
  found to terminate" when gone); saveRegistryAuth / deleteRegistryAuth (`registry_auths`), and a
  deploy naming a containerRegistryAuthId that does not exist is refused.
Pods: runtime is null for `boot_polls` reads (RUNNING while the image pulls), then 22/tcp points
at the test sshd. The image side is modelled as the contract gpuctl's image honours: the keys in
env SSH_PUBLIC_KEY (per pod) and PUBLIC_KEY (RunPod puts the account's key there,
`account_key`) go into authorized_keys, and come out again when the pod is terminated.
`error_status`: answer resolver errors with this HTTP status instead of 200 (RunPod sometimes
sends 4xx/5xx with errors[]). Every operation is logged in `ops` (root field, coerced input,
selected field paths) for the oracle tests. Auth: Bearer KEY or ?api_key=KEY; else 401.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from graphql import GraphQLError, build_schema, execute, parse, validate
from graphql.language import FieldNode

from tests.fakes.base import ApiError, FakeApi

SCHEMA = build_schema("""
scalar Void
enum CloudTypeEnum { ALL SECURE COMMUNITY }

type Query {
  gpuTypes(input: GpuTypeFilter): [GpuType]
  pod(input: PodFilter): Pod
  myself: User
}
type Mutation {
  podFindAndDeployOnDemand(input: PodFindAndDeployOnDemandInput): Pod
  podRentInterruptable(input: PodRentInterruptableInput!): Pod
  podTerminate(input: PodTerminateInput!): Void
  saveRegistryAuth(input: SaveRegistryAuthInput!): ContainerRegistryAuth
  deleteRegistryAuth(registryAuthId: String!): Void
}
input SaveRegistryAuthInput { name: String!, username: String!, password: String! }
type ContainerRegistryAuth { id: String, name: String }

input GpuTypeFilter { id: String }
input GpuLowestPriceInput {
  gpuCount: Int, minMemoryInGb: Int, minVcpuCount: Int, secureCloud: Boolean, supportPublicIp: Boolean,
  minDisk: Int, minDownload: Int, minUpload: Int, totalDisk: Int, dataCenterId: String, countryCode: String,
  minCudaVersion: String
}
type LowestPrice {
  gpuName: String, gpuTypeId: String, minimumBidPrice: Float, uninterruptablePrice: Float,
  minMemory: Int, minVcpu: Int, stockStatus: String, totalCount: Int, rentedCount: Int
}
type GpuType {
  id: String, displayName: String, manufacturer: String, memoryInGb: Int, cudaCores: Int,
  maxGpuCount: Int, secureCloud: Boolean, communityCloud: Boolean, securePrice: Float,
  communityPrice: Float, oneMonthPrice: Float, threeMonthPrice: Float, oneWeekPrice: Float,
  communitySpotPrice: Float, secureSpotPrice: Float, lowestPrice(input: GpuLowestPriceInput): LowestPrice
}

input EnvironmentVariableInput { key: String!, value: String! }
input PodFindAndDeployOnDemandInput {
  name: String!, imageName: String!, cloudType: CloudTypeEnum!, gpuTypeId: String!, gpuCount: Int,
  volumeInGb: Int, containerDiskInGb: Int, minVcpuCount: Int, minMemoryInGb: Int, dockerArgs: String,
  ports: String, volumeMountPath: String, env: [EnvironmentVariableInput], startSsh: Boolean,
  startJupyter: Boolean, supportPublicIp: Boolean, dataCenterId: String, countryCode: String,
  templateId: String, networkVolumeId: String, allowedCudaVersions: [String], minDownload: Int,
  minUpload: Int, cudaVersion: String, volumeKey: String, containerRegistryAuthId: String
}
input PodRentInterruptableInput {
  bidPerGpu: Float!, name: String!, imageName: String!, cloudType: CloudTypeEnum!, gpuTypeId: String!,
  gpuCount: Int, volumeInGb: Int, containerDiskInGb: Int, minVcpuCount: Int, minMemoryInGb: Int,
  dockerArgs: String, ports: String, volumeMountPath: String, env: [EnvironmentVariableInput],
  startSsh: Boolean, startJupyter: Boolean, supportPublicIp: Boolean, dataCenterId: String,
  countryCode: String, templateId: String, networkVolumeId: String, allowedCudaVersions: [String],
  containerRegistryAuthId: String
}
input PodFilter { podId: String! }
input PodTerminateInput { podId: String! }

type PodRuntimePorts { ip: String, isIpPublic: Boolean, privatePort: Int, publicPort: Int, type: String }
type PodRuntimeGpus { id: String, gpuUtilPercent: Int, memoryUtilPercent: Int }
type PodRuntime { uptimeInSeconds: Int, ports: [PodRuntimePorts], gpus: [PodRuntimeGpus] }
type PodMachine { podHostId: String, gpuDisplayName: String }
type Pod {
  id: String, name: String, desiredStatus: String, imageName: String, costPerHr: Float, gpuCount: Int,
  memoryInGb: Float, vcpuCount: Float, containerDiskInGb: Int, volumeInGb: Float, volumeMountPath: String,
  env: [String], ports: String, port: Int, dockerArgs: String, dockerId: String, uptimeSeconds: Int,
  lastStatusChange: String, machineId: String, podType: String, runtime: PodRuntime, machine: PodMachine
}
type User { id: String, pods: [Pod] }
""")
NO_CAPACITY = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)
KEY_VARS = ("SSH_PUBLIC_KEY", "PUBLIC_KEY")  # what gpuctl's image entrypoint installs


def gpu_type(id="NVIDIA GeForce RTX 4090", name="RTX 4090", secure=0.69, community=0.34) -> dict:
    return {
        "id": id,
        "displayName": name,
        "manufacturer": "Nvidia",
        "memoryInGb": 24,
        "cudaCores": 16384,
        "securePrice": secure,
        "communityPrice": community,
        "secureSpotPrice": round(secure * 0.6, 3),
        "communitySpotPrice": round(community * 0.6, 3),
        "maxGpuCount": 8,
        "secureCloud": True,
        "communityCloud": True,
    }


@dataclass
class Op:
    """One GraphQL root field as executed: what the oracle tests compare."""

    root: str
    input: dict | None
    fields: set[str]  # selected field paths below the root, aliases resolved


def _paths(nodes, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, FieldNode) and node.selection_set:
            for child in node.selection_set.selections:
                if isinstance(child, FieldNode):
                    path = f"{prefix}{child.name.value}"
                    out.add(path)
                    out |= _paths([child], path + ".")
    return out


@dataclass
class FakeRunPod(FakeApi):
    gpu_types: list[dict] = field(
        default_factory=lambda: [gpu_type(), gpu_type("NVIDIA RTX A6000", "RTX A6000", 0.79, 0.49)]
    )
    host_memory_gb: int = 251  # the biggest machine: minMemoryInGb above this finds none
    host_cuda: str = "12.8"  # the machines' driver CUDA: allowedCudaVersions without it finds none
    host_upload_mbps: int = 1000  # the machines' uplink: minUpload above this finds none
    pods: dict[str, dict] = field(default_factory=dict)
    terminated: list[str] = field(default_factory=list)
    deploy_inputs: list[dict] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    boot_polls: int = 2
    account_key: str | None = None  # the key in the account's settings: RunPod injects it as PUBLIC_KEY
    error_status: int = 200
    price_moves: float = 0.0  # $/h per GPU added at deploy: the price moved between search and create
    machines: list[str] = field(default_factory=list)  # machineId of the next pods (RunPod picks); then m-<pod>
    registry_auths: dict[str, dict] = field(default_factory=dict)  # id -> {name, username, password}

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
        try:
            document = parse(body["query"])
        except GraphQLError as err:
            return 400, {"errors": [err.formatted]}
        invalid = validate(SCHEMA, document)
        if invalid:
            return 400, {"errors": [e.formatted for e in invalid]}
        result = execute(SCHEMA, document, root_value=self, variable_values=body.get("variables") or {})
        if result.data is None:  # the variables did not fit their types
            return 400, {"errors": [e.formatted for e in result.errors or []]}
        if result.errors:
            return self.error_status, {"errors": [e.formatted for e in result.errors], "data": result.data}
        return 200, {"data": result.data}

    def _log(self, info, input) -> None:
        self.ops.append(Op(info.field_name, input, _paths(info.field_nodes)))

    # resolvers: graphql-core calls root_value.<field>(info, **args) -----------------------------
    def gpuTypes(self, info, input=None):
        self._log(info, input)
        wanted = (input or {}).get("id")
        return [self._gpu_row(g) for g in self.gpu_types if not wanted or g["id"] == wanted]

    def _gpu_row(self, gpu: dict) -> dict:
        row = dict(gpu)
        row["lowestPrice"] = lambda info, input=None: self._lowest(gpu, input or {})
        return row

    def _lowest(self, gpu: dict, want: dict) -> dict:
        self.ops.append(Op("gpuTypes.lowestPrice", want, set()))
        secure = want.get("secureCloud", True)
        if (want.get("minMemoryInGb") or 0) > self.host_memory_gb or (want.get("gpuCount") or 1) > gpu["maxGpuCount"]:
            return {"minimumBidPrice": None, "uninterruptablePrice": None, "stockStatus": None}
        return {
            "gpuTypeId": gpu["id"],
            "gpuName": gpu["displayName"],
            "minimumBidPrice": gpu["secureSpotPrice" if secure else "communitySpotPrice"],
            "uninterruptablePrice": gpu["securePrice" if secure else "communityPrice"],
            "minMemory": self.host_memory_gb,
            "minVcpu": 16,
            "stockStatus": "High",
        }

    def podFindAndDeployOnDemand(self, info, input=None):
        self._log(info, input)
        return self._deploy(input or {}, spot=False)

    def podRentInterruptable(self, info, input):
        self._log(info, input)
        return self._deploy(input, spot=True)

    def pod(self, info, input=None):
        self._log(info, input)
        pod = self.pods.get((input or {}).get("podId"))
        return self._view(pod) if pod else None

    def myself(self, info):
        self._log(info, None)
        return {"id": "user_fake", "pods": [self._view(p) for p in self.pods.values()]}

    def podTerminate(self, info, input):
        self._log(info, input)
        pod = self.pods.pop(input["podId"], None)
        if pod is None:
            raise GraphQLError("pod not found to terminate")
        for key in pod["_keys"]:
            if self.ssh:
                self.ssh.remove_key(key)
        self.terminated.append(pod["id"])
        return None

    def saveRegistryAuth(self, info, input):
        self._log(info, input)
        if any(a["name"] == input["name"] for a in self.registry_auths.values()):
            raise GraphQLError("Registry auth with this name already exists")
        auth_id = f"fakeauth{len(self.registry_auths) + 1:04d}"
        self.registry_auths[auth_id] = dict(input)
        return {"id": auth_id, "name": input["name"]}

    def deleteRegistryAuth(self, info, registryAuthId):
        self._log(info, {"registryAuthId": registryAuthId})
        if self.registry_auths.pop(registryAuthId, None) is None:
            raise GraphQLError("Registry auth not found")
        return None

    # pods ----------------------------------------------------------------------------------------
    def _deploy(self, arg: dict, spot: bool) -> dict:
        gpu = next((g for g in self.gpu_types if g["id"] == arg["gpuTypeId"]), None)
        if gpu is None or (arg.get("minMemoryInGb") or 0) > self.host_memory_gb:
            raise GraphQLError(NO_CAPACITY)
        if arg.get("allowedCudaVersions") and self.host_cuda not in arg["allowedCudaVersions"]:
            raise GraphQLError(NO_CAPACITY)
        if (arg.get("minUpload") or 0) > self.host_upload_mbps:
            raise GraphQLError(NO_CAPACITY)
        if arg.get("containerRegistryAuthId") and arg["containerRegistryAuthId"] not in self.registry_auths:
            raise GraphQLError("Container registry auth not found")  # a pod whose image cannot be pulled
        self.deploy_inputs.append(arg)
        secure = arg["cloudType"] == "SECURE"
        per_gpu = (arg["bidPerGpu"] if spot else gpu["securePrice" if secure else "communityPrice"]) + self.price_moves
        env = {e["key"]: e["value"] for e in arg.get("env") or []}
        if self.account_key and "PUBLIC_KEY" not in env:
            env["PUBLIC_KEY"] = self.account_key
        keys = [env[k] for k in KEY_VARS if env.get(k)]
        pod = {
            "id": next(self._ids),
            "name": arg["name"],
            "imageName": arg["imageName"],
            "gpuCount": arg.get("gpuCount") or 1,
            "costPerHr": round(per_gpu * (arg.get("gpuCount") or 1), 3),
            "env": [f"{k}={v}" for k, v in env.items()],
            "ports": arg.get("ports"),
            "containerDiskInGb": arg.get("containerDiskInGb"),
            "volumeInGb": arg.get("volumeInGb"),
            "machineId": self.machines.pop(0) if self.machines else f"m-{len(self.terminated) + len(self.pods) + 1}",
            "_reads": 0,
            "_keys": keys,
            "_gpu": gpu,
        }
        for key in keys:
            if self.ssh:
                self.ssh.add_key(key)
        self.pods[pod["id"]] = pod
        return self._view(pod, count=False)

    def preempt(self, pod_id: str) -> None:
        """Take a spot pod back mid-run: it reports EXITED with no runtime, and its SSH keys stop working."""
        with self.lock:
            pod = self.pods[pod_id]
            pod["_exited"] = True
            for key in pod["_keys"]:
                if self.ssh:
                    self.ssh.remove_key(key)

    def _view(self, pod: dict, count: bool = True) -> dict:
        if count:
            pod["_reads"] += 1
        booted = pod["_reads"] > self.boot_polls and self.ssh is not None and not pod.get("_exited")
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
            desiredStatus="EXITED" if pod.get("_exited") else "RUNNING",
            runtime=runtime,
            uptimeSeconds=pod["_reads"],
            machine={"podHostId": f"{pod['id']}-host", "gpuDisplayName": pod["_gpu"]["displayName"]},
        )
        return view
