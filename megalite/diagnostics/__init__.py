"""Why a run hangs: the flight recorder megalite.comm writes, hang dumps, the diagnosis that
names the rank the others wait on, and the pre-launch collective check."""
