"""How long a test waits before it calls a wait a hang.

Only a guard against hangs: users run the suite on slow and busy machines (a server's warm-up
took 727 s on one with a load average of 8), so no test waits for anything against a speed.
"""

HANG_S = 3600.0
