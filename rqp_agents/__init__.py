"""The RQP message channel agents (the daemons). Installed as ``rqp_agents``."""
