"""dynsnap: suspend idle NVIDIA Dynamo workers and wake them in place, verified.

Layers (DESIGN.md section 3, enforced by import-linter in the test run):
``cli`` -> ``controller`` | ``agent`` | ``testenv`` -> ``runtime`` -> ``k8s`` -> ``telemetry`` -> ``models``.
"""

__version__ = "0.1.0"
