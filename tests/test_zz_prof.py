import time, pytest
from tests.test_image import *  # noqa
from tests.test_image import write_context, image
def test_prof(tmp_path, laptop, node, node_docker):
    from provision.config import GpuctlConfig
    ctx = write_context(tmp_path / "ctx", marker="x")
    cfg = GpuctlConfig.model_validate({"docker": {"context": str(ctx)}})
    t = time.time()
    def say(m): print(f"{time.time()-t:6.2f} {m}")
    r = image.ship(node, "p:1", "build", cfg=cfg, say=say); say(r)
    r = image.ship(node, "p:1", "build", cfg=cfg, say=say); say(r)
    t2 = time.time(); node_docker.docker("run", "--rm", "--network", "host", "p:1", "true"); say(f"run {time.time()-t2:.2f}")
    t2 = time.time(); node.run(["true"]); say(f"ssh true {time.time()-t2:.2f}")
