#!/bin/bash
# The per-node script as the seeds have it (Qwen's finetune_lora_ds.sh, multi-node part).
# Copy it (with finetune.py and ds_config_zero2.json) to the job's workdir on shared storage.
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count())')}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6001}
MODEL="Qwen/Qwen-7B-Chat"
DATA="data/train_data.json"
DS_CONFIG_PATH="ds_config_zero2.json"

torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  finetune.py \
    --model_name_or_path "$MODEL" --data_path "$DATA" --bf16 True \
    --output_dir output_qwen --num_train_epochs 5 \
    --per_device_train_batch_size 2 --gradient_accumulation_steps 8 \
    --learning_rate 3e-4 --weight_decay 0.1 --warmup_ratio 0.01 --lr_scheduler_type cosine \
    --model_max_length 512 --save_strategy steps --save_steps 1000 --save_total_limit 3 \
    --lazy_preprocess True --use_lora --gradient_checkpointing \
    --deepspeed "$DS_CONFIG_PATH"
