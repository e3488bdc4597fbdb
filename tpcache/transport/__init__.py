"""The step channel: the coordinator's hub, the Unix links to ranks on its node, CURVE TCP
links to ranks on other nodes, private directories, and the CURVE helpers every
network socket uses.

May import ``tpcache.errors`` only; no torch, no Ray.
"""
