"""Deployment helpers that are code, not containers.

ray_pool   a verifier pool on Ray: N replicas (Ray actors, each a verifier gRPC server that
           registers in Redis), autoscaled between min and max by measured load, drained first
           on scale-down. python -m deploy.ray_pool --replicas 2 --model DIR --redis-url URL
"""
