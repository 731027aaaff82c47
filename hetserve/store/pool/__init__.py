"""hetserve's own KV pool: a master keeps metadata, nodes hold bytes, clients move the bytes
directly to and from nodes (TCP, or shared memory on the same host)."""
