"""Drafter training: data from the target, stage 1 (DSpark) and stage 2 (M-DFlash), held-out tau."""
from dpara_rt.train.data import TrainData, build_train_data, prompts_from_stream
from dpara_rt.train.evaluate import estimate_tau
from dpara_rt.train.loop import TrainConfig, TrainResult, train_stage1, train_stage2

__all__ = ["TrainConfig", "TrainData", "TrainResult", "build_train_data", "estimate_tau", "prompts_from_stream",
           "train_stage1", "train_stage2"]
