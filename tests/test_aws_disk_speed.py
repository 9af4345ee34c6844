"""AWS root volume speed: gp3 gives 125 MiB/s unless asked, so a 97 GB ZeRO save would block training ~13
minutes. `up` provisions Throughput/Iops sized by plan's checkpoint (about 5 minutes a save, within gp3's
125-1000 MiB/s and 3000-16000 IOPS) and says so; moto's EC2 gets run_instances with them."""

from __future__ import annotations

import pytest

from provision.core.config import GpuctlConfig, load_config
from provision.estimate.sizing import SAVE_WRITE_S, gp3_performance, node_figures, sized_provider
from provision.providers import aws
from provision.providers.base import UpOptions
from tests.fakes.harness import write_config
from tests.test_cloud_aws import ec2, instance_key, moto_url, provider, register_amis  # noqa: F401

SEED_TRAIN = {"model": "deepseek-7b", "precision": "fp16", "seq_len": 2048, "gradient_checkpointing": True}


def test_gp3_is_sized_to_write_a_checkpoint_in_bounded_time():
    assert gp3_performance(1.0) == (125, 3000)  # small saves: gp3's baseline
    mibs, iops = gp3_performance(96.75)
    assert 96.75e9 / 2**20 / mibs <= SAVE_WRITE_S and iops >= mibs / 0.25 and iops >= 3000
    assert gp3_performance(10_000) == (1000, 4000)  # capped at gp3's 1000 MiB/s; 0.25 MiB/s per IOPS
    cfg = GpuctlConfig.model_validate({"provider": {"kind": "aws"}, "train": SEED_TRAIN})
    sized = sized_provider(cfg)
    req = node_figures(cfg)
    assert req is not None and (sized.disk_throughput_mbps, sized.disk_iops) == gp3_performance(req.checkpoint_gb)
    mine = sized_provider(GpuctlConfig.model_validate({"provider": {"kind": "aws", "disk_throughput_mbps": 900}}))
    assert mine.disk_throughput_mbps == 900  # the user's word wins


@pytest.mark.timeout(240)
def test_up_provisions_the_root_volume_speed_and_says_it(project, gpuctl, ec2, tmp_path, sshd, state_dir, monkeypatch):  # noqa: F811
    register_amis(ec2)
    write_config(project, provider(ec2, tmp_path, sshd, min_ram_gb=192, disk_gb=400), name="aws-d", **SEED_TRAIN)
    instance_key(sshd, "aws-d")
    cfg = load_config(project / "gpuctl.yaml")
    sent: list[dict] = []
    real = aws.ec2

    def spying(region, endpoint_url):
        client = real(region, endpoint_url)
        client.meta.events.register("provide-client-params.ec2.RunInstances", lambda params, **_: sent.append(params))
        return client

    monkeypatch.setattr(aws, "ec2", spying)
    said: list[str] = []
    from provision.flows import cluster

    record = cluster.up(cfg, UpOptions(assume_yes=True, say=said.append, doctor=False))  # this machine is no 7B host
    mibs, iops = gp3_performance(node_figures(cfg).checkpoint_gb)
    assert mibs > 125
    ebs = sent[0]["BlockDeviceMappings"][0]["Ebs"]
    assert (ebs["VolumeType"], ebs["Throughput"], ebs["Iops"], ebs["VolumeSize"]) == ("gp3", mibs, iops, 400)
    node = record.nodes[0]
    volumes = ec2.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [node.instance_id]}])
    assert [v["Iops"] for v in volumes["Volumes"]] == [iops]  # moto keeps Iops (not Throughput) on the volume
    assert any(f"root gp3 volume {mibs} MiB/s, {iops} IOPS" in line for line in said), said
    assert gpuctl("down", "--yes").returncode == 0
