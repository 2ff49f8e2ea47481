"""Runs a JAX benchmark script of this folder on the PJRT plugin meshwork loads.

JAX's own CPU client is jaxlib's build of XLA; the `xla-cpu-pjrt` plugin is another
build. Running the same JAX script on the plugin (`MESHWORK_PJRT_PLUGIN`, asked for 4
CPU devices) compares meshwork and JAX on one XLA.

    MESHWORK_PJRT_PLUGIN=plugin.so python3 on_pjrt_plugin.py transformer_train_jax.py 5
"""
import os
import runpy
import sys

import jax
from jax._src import xla_bridge

xla_bridge.register_plugin(
    "meshwork_plugin", library_path=os.environ["MESHWORK_PJRT_PLUGIN"],
    options={"cpu_device_count": 4})
jax.config.update("jax_platforms", "meshwork_plugin")
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), sys.argv[1])
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
