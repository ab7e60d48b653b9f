#!/usr/bin/env bash
# Seeds the atom index fuzz corpus (CORPUS_DIR, $1) with valid documents: flat and box
# fragments, a 0-d atom, an optional rank, groups and carried objects, an atoms store, chunk
# hashes.
set -euo pipefail
corpus=$1
mkdir -p "$corpus"
cat >"$corpus/seed_flat" <<'JSON'
{"format": "ucp-atom-index", "version": 1,
 "framework": {"name": "deepspeed", "version": "0.14.5"},
 "adapter": {"name": "deepspeed-zero12", "schema": 1},
 "tag": "global_step5",
 "topology": {"dp": 2, "tp": 1, "pp": 1, "world": 2, "zero_stage": 2},
 "files": [{"path": "mp_rank_00_model_states.pt", "size": 100, "xxh3": "0123456789abcdef",
            "role": "model_states"},
           {"path": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "size": 256,
            "xxh3": "00000000000000ff", "role": "optim_states", "rank": {"dp": 0, "tp": 0, "pp": 0}},
           {"path": "zero_pp_rank_1_mp_rank_00_optim_states.pt", "size": 256,
            "xxh3": "ffffffffffffffff", "role": "optim_states", "rank": {"dp": 1, "tp": 0, "pp": 0}}],
 "atoms": [{"param": "w", "state": "fp32", "dtype": "float32", "shape": [3, 4],
            "fragments": [{"file": 1, "offset": 64, "dtype": "float32", "region": {"flat": [0, 7]}},
                          {"file": 2, "offset": 64, "dtype": "float32", "region": {"flat": [7, 12]}}]},
           {"param": "w", "state": "step", "dtype": "int64", "shape": [],
            "fragments": [{"file": 1, "offset": 8, "dtype": "int64", "region": {"flat": [0, 1]}}]}],
 "groups": [{"params": ["w"], "hyperparameters": {"lr": 0.003, "betas": [0.9, 0.999]},
             "scalars": {"step": 5}}],
 "carried": [{"role": "model_states", "file": 0, "rewritten": ["dp_world_size"]}],
 "adapter_state": {"partition_count": [2]}}
JSON
cat >"$corpus/seed_box" <<'JSON'
{"format": "ucp-atom-index", "version": 1,
 "framework": {"name": "megatron", "version": "0"},
 "adapter": {"name": "test", "schema": 3},
 "tag": "t",
 "topology": {"dp": 1, "tp": 2, "pp": 1, "world": 2, "zero_stage": 0},
 "files": [{"path": "a/x.pt", "size": 4096, "xxh3": "0000000000000000", "role": "r"}],
 "atoms": [{"param": "e", "state": "fp32", "dtype": "bfloat16", "shape": [4, 6],
            "fragments": [{"file": 0, "offset": 0, "dtype": "bfloat16",
                           "region": {"box": {"offsets": [0, 0], "extents": [4, 3]}}},
                          {"file": 0, "offset": 64, "dtype": "bfloat16",
                           "region": {"box": {"offsets": [0, 3], "extents": [4, 3]}}}]}],
 "groups": [], "carried": [], "adapter_state": {}}
JSON
cat >"$corpus/seed_store" <<'JSON'
{"format": "ucp-atom-index", "version": 2,
 "framework": {"name": "deepspeed", "version": "0.14.5"},
 "adapter": {"name": "deepspeed-zero12", "schema": 1},
 "tag": "global_step5",
 "topology": {"dp": 1, "tp": 1, "pp": 1, "world": 1, "zero_stage": 2},
 "files": [{"path": "mp_rank_00_model_states.pt", "size": 100, "xxh3": "0123456789abcdef",
            "role": "model_states"},
           {"path": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "size": 256,
            "xxh3": "00000000000000ff", "role": "optim_states", "rank": {"dp": 0, "tp": 0, "pp": 0}},
           {"path": ".ucp/atoms/fp32/model.safetensors", "size": 112, "xxh3": "0000000000000007",
            "role": "ucp-atoms"},
           {"path": ".ucp/atoms/carried.mp_rank_00_model_states.pt", "size": 100,
            "xxh3": "0123456789abcdef", "role": "ucp-copy", "copy_of": 0}],
 "atoms": [{"param": "w", "state": "fp32", "dtype": "float32", "shape": [3, 4],
            "fragments": [{"file": 1, "offset": 64, "dtype": "float32", "region": {"flat": [0, 12]}}],
            "consolidated": {"file": 2, "offset": 64}}],
 "groups": [{"params": ["w"], "hyperparameters": {"lr": 0.003}, "scalars": {"step": 5}}],
 "carried": [{"role": "model_states", "file": 0, "rewritten": ["dp_world_size"]}],
 "adapter_state": {},
 "store": {"directory": ".ucp/atoms", "max_shard_bytes": 16777216}}
JSON
cat >"$corpus/seed_chunks" <<'JSON'
{"format": "ucp-atom-index", "version": 3,
 "framework": {"name": "deepspeed", "version": "0.19.8"},
 "adapter": {"name": "deepspeed-zero12", "schema": 1},
 "tag": "global_step5",
 "topology": {"dp": 1, "tp": 1, "pp": 1, "world": 1, "zero_stage": 2},
 "files": [{"path": "mp_rank_00_model_states.pt", "size": 100, "xxh3": "0123456789abcdef",
            "role": "model_states", "chunk_bytes": 64,
            "chunks": "00000000000000010000000000000002"},
           {"path": "zero_pp_rank_0_mp_rank_00_optim_states.pt", "size": 256,
            "xxh3": "00000000000000ff", "role": "optim_states", "rank": {"dp": 0, "tp": 0, "pp": 0},
            "chunk_bytes": 1048576, "chunks": "00000000000000ff"}],
 "atoms": [{"param": "w", "state": "fp32", "dtype": "float32", "shape": [3, 4],
            "fragments": [{"file": 1, "offset": 64, "dtype": "float32", "region": {"flat": [0, 12]}}]}],
 "groups": [{"params": ["w"], "hyperparameters": {"lr": 0.003}, "scalars": {"step": 5}}],
 "carried": [{"role": "model_states", "file": 0, "rewritten": ["dp_world_size"]}],
 "adapter_state": {}}
JSON
