"""Import hook for verl's CPU platform: name it first in ``VERL_USE_EXTERNAL_MODULES``
(``compass_kernels.integration.cpu.verl_plugin,compass_kernels.integration.verl.plugin``);
verl imports it in the driver, every Ray worker and vLLM's engine process, and it calls
:func:`compass_kernels.integration.cpu.verl_platform.activate` there (errors raise: a job
never runs on half a platform)."""

from compass_kernels.integration.cpu.verl_platform import activate

activate()
