"""Engine build (``llmx build``): TensorRT engines for an artifact, as a stage of its own.

    tensorrt.py      plan_build / build_artifact: precision, engines, profiles, the new artifact
    precision.py     fp16/bf16 graphs for engines; what Q/DQ a graph holds
    trt_profiles.py  the engines of a layout and their optimization profiles
    trt_build.py     one engine through Polygraphy (needs TensorRT and a GPU)
    trt_records.py   build-side checks: precision per GPU, timing caches, INT8 calibration tables

What the runtime needs from a build (limits, profiles, the engine record) lives in the core
contract (llmx/artifact/tensorrt.py, llmx/artifact/tensorrt.py): the runtime never imports this stage.
"""
