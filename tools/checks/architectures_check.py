"""kernels.patch() against eager and float64 on transformers architectures built from config, at sizes where the
library's paths engage (split GEMMs, the norms, silu_mul, gelu_tanh, the q/k/v grouping while training).

    python tools/device_check.py architectures                     # the default set on the GPU, into $OUT
    python tools/checks/architectures_check.py --only llama,bert
    python tools/checks/architectures_check.py --all               # every architecture with a builder here
    python tools/checks/architectures_check.py --device cpu --hidden 64 --heads 4 --seq 16 --batch 2 --vocab 100

Per architecture, float32 on --device, train mode, every dropout zeroed, TF32 off:
  A = the model (seed 0), B = kernels.patch(deepcopy(A)), A64 = deepcopy(A).double()
  0. patch() changed at least one module.
  1. no_grad forward of A, B, A64. err(M) = ||y_M - y64|| / ||y64|| over the main output (logits, else
     last_hidden_state; CLIP and SigLIP: logits_per_image and both embeddings, concatenated).
     Pass: err(B) <= 1.25 err(A) + 1e-7, allclose(B, A, rtol=atol=1e-4), all finite.
  2. Training call 1: loss = (out * a fixed randn).mean() (--loss proj; square: out.square().mean(), whose gradient
     before a model's final norm is mostly rounding), backward; every parameter's gradient as one vector: err(B) <=
     1.25 err(A) + 1e-7; each parameter's: B's error at most 2x A's plus 1e-7 of the whole gradient's norm; finite;
     the same parameters with a gradient in A and B (paired by name).
  3. An AdamW step (lr 1e-4) on A, B and A64, then training call 2 (the library computes grouped q/k/v projections as
     one product from here): the checks of 1 on its output and of 2 on its gradients.
  Where eager's own gradient error exceeds KINK_ERROR (far above float32's rounding), it comes from values at a kink
  that float32 and float64 put on different sides (a ReLU's pre-activations within rounding of zero: T5's and OPT's
  MLPs), where A and B differ by chance, and an AdamW step turns that into different weights: steps 2 and 3 then allow B
  KINK_FACTOR times A's error (a zeroed or scaled gradient still fails), without allclose after the step.
  split f/n: of the first forward's n linear calls (taken by pre-hooks on A: B makes the same calls, and hooks on B
  would change what it groups), those whose product takes a split path; b: those where a backward product may.
An exception is recorded with its traceback and the next architecture runs. JSON lines into <--out>/architectures.jsonl.
"""
import argparse
import copy
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

import torch
from torch import nn

import transformers as T

DEFAULT_SET = ["llama", "mistral", "qwen2", "gemma", "phi3", "mixtral", "gpt2", "gptj", "gpt_neox", "opt", "bloom",
               "falcon", "bert", "roberta", "distilbert", "deberta_v2", "electra", "modernbert", "t5", "bart",
               "whisper", "vit", "clip", "swin", "wav2vec2"]


# ------------------------------------------------------------------------------------------------ builders
def zero_dropout(cfg):
    """Every float config field about dropout / drop path / layerdrop / masking -> 0 (also nested sub-configs)."""
    def fix(c):
        for k in list(vars(c)):
            v = getattr(c, k)
            lk = k.lower()
            if isinstance(v, float) and ("drop" in lk or lk in ("mask_time_prob", "mask_feature_prob")
                                        or lk.endswith("pdrop")):
                setattr(c, k, 0.0)
            elif isinstance(v, T.PretrainedConfig):
                fix(v)
        for k in ("text_config", "vision_config", "encoder", "decoder", "audio_config"):
            sub = getattr(c, k, None)
            if isinstance(sub, T.PretrainedConfig):
                fix(sub)
    fix(cfg)
    return cfg


def make_archs(P):
    """name -> builder() returning (model on the CPU, inputs on the CPU), at the sizes of P."""
    H, NH, L, V, S, Bt = P.hidden, P.heads, P.layers, P.vocab, P.seq, P.batch
    I = 4 * H                         # intermediate size
    HD = H // NH                      # head dim
    KV = max(1, NH // 4)              # kv heads (GQA)
    MP = max(64, S + 8)               # max positions (RoBERTa-likes offset theirs by pad + 1)
    SW = max(8, (S // 4) // 2 * 2)    # sliding / local windows
    PATCH = 16 if S >= 64 else 8      # ViT-likes: image of >= S patches
    IMG = PATCH * math.ceil(math.sqrt(S))
    SG = 8 * math.ceil(math.sqrt(4 * S) / 8)  # Swin-likes: stage-1 grid (window 8), >= 4 S tokens, patch 4
    CD = max(32, H // 4)              # wav2vec2-likes: conv feature dim

    def ids(vocab=V, seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (Bt, S), generator=g)

    def floats(*shape, seed=2):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g)

    def mk(cfg_cls, model_cls, base, kw):
        base = dict(base)
        base.update(kw)
        base = {k: v for k, v in base.items() if v is not None}
        return getattr(T, model_cls)(zero_dropout(getattr(T, cfg_cls)(**base)))

    def dec_llm(cfg_cls, model_cls, **kw):
        base = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                    num_key_value_heads=KV, vocab_size=V, max_position_embeddings=MP)
        return lambda: (mk(cfg_cls, model_cls, base, kw), {"input_ids": ids()})

    def enc_bert(cfg_cls, model_cls, **kw):
        base = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                    vocab_size=V, max_position_embeddings=MP)
        return lambda: (mk(cfg_cls, model_cls, base, kw), {"input_ids": ids()})

    def seq2seq(cfg_cls, model_cls, **kw):
        base = dict(d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                    decoder_attention_heads=NH, encoder_ffn_dim=I, decoder_ffn_dim=I, vocab_size=V,
                    max_position_embeddings=MP, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                    decoder_start_token_id=2)
        return lambda: (mk(cfg_cls, model_cls, base, kw), {"input_ids": ids(), "decoder_input_ids": ids(seed=3)})

    def vision(cfg_cls, model_cls, size=IMG, **kw):
        base = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I,
                    image_size=size, patch_size=PATCH, num_channels=3)
        hw = (size, size) if isinstance(size, int) else tuple(size)
        return lambda: (mk(cfg_cls, model_cls, base, kw), {"pixel_values": floats(Bt, 3, *hw)})

    def text_cfg():
        return dict(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH, vocab_size=V,
                    max_position_embeddings=MP)

    def vision_cfg():
        return dict(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                    image_size=IMG, patch_size=PATCH)

    def build_clip():
        cfg = T.CLIPConfig(text_config=text_cfg(), vision_config=vision_cfg(), projection_dim=min(H, 512))
        return T.CLIPModel(zero_dropout(cfg)), {"input_ids": ids(), "pixel_values": floats(Bt, 3, IMG, IMG)}

    def build_siglip():
        cfg = T.SiglipConfig(text_config=text_cfg(), vision_config=vision_cfg())
        return T.SiglipModel(zero_dropout(cfg)), {"input_ids": ids(), "pixel_values": floats(Bt, 3, IMG, IMG)}

    def build_whisper():
        cfg = T.WhisperConfig(d_model=H, encoder_layers=L, decoder_layers=L, encoder_attention_heads=NH,
                              decoder_attention_heads=NH, encoder_ffn_dim=I, decoder_ffn_dim=I, vocab_size=V,
                              num_mel_bins=80, max_source_positions=S, max_target_positions=MP,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        return (T.WhisperForConditionalGeneration(zero_dropout(cfg)),
                {"input_features": floats(Bt, 80, 2 * S), "decoder_input_ids": ids()})

    def build_wav2vec2(cls_cfg="Wav2Vec2Config", cls_model="Wav2Vec2Model", **kw):
        def f():
            base = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I,
                        conv_dim=(CD, CD), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                        num_conv_pos_embedding_groups=4, vocab_size=V, mask_time_prob=0.0)
            # 10 S + 10 samples -> S frames after the two convolutions
            return mk(cls_cfg, cls_model, base, kw), {"input_values": floats(Bt, 10 * S + 10)}
        return f

    def swin_like(cfg_cls, model_cls):
        def f():
            cfg = getattr(T, cfg_cls)(image_size=4 * SG, patch_size=4, embed_dim=H // 2, depths=[1, 1],
                                      num_heads=[max(1, NH // 2), NH], window_size=8 if SG >= 16 else 4,
                                      num_channels=3)
            return getattr(T, model_cls)(zero_dropout(cfg)), {"pixel_values": floats(Bt, 3, 4 * SG, 4 * SG)}
        return f

    def build_convnext():
        cfg = T.ConvNextConfig(hidden_sizes=[H // 2, H], depths=[1, 1], num_stages=2, num_channels=3,
                               image_size=4 * SG)
        return T.ConvNextModel(zero_dropout(cfg)), {"pixel_values": floats(Bt, 3, 4 * SG, 4 * SG)}

    def build_t5(model_cls="T5ForConditionalGeneration", cfg_cls="T5Config", **kw):
        def f():
            base = dict(d_model=H, d_ff=I, d_kv=HD, num_layers=L, num_decoder_layers=L, num_heads=NH,
                        vocab_size=V, decoder_start_token_id=0, pad_token_id=0)
            m = mk(cfg_cls, model_cls, base, kw)
            inp = {"input_ids": ids()}
            if "Encoder" not in model_cls:
                inp["decoder_input_ids"] = ids(seed=3)
            return m, inp
        return f

    def build_vit_mae():
        cfg = T.ViTMAEConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I,
                             image_size=IMG, patch_size=PATCH, decoder_hidden_size=H // 2,
                             decoder_num_hidden_layers=1, decoder_num_attention_heads=max(1, NH // 2),
                             decoder_intermediate_size=2 * H, mask_ratio=0.0)
        return T.ViTMAEModel(zero_dropout(cfg)), {"pixel_values": floats(Bt, 3, IMG, IMG)}

    gpt_neo_types = [[["global", "local"], L // 2]] + ([[["global"], 1]] if L % 2 else [])
    ast_t = 16 * math.ceil(S / 4)
    return {
        # decoder-only LLMs
        "llama": dec_llm("LlamaConfig", "LlamaForCausalLM"),
        "mistral": dec_llm("MistralConfig", "MistralForCausalLM"),
        "qwen2": dec_llm("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": dec_llm("Qwen3Config", "Qwen3ForCausalLM", head_dim=HD),
        "gemma": dec_llm("GemmaConfig", "GemmaForCausalLM", head_dim=HD),
        "gemma2": dec_llm("Gemma2Config", "Gemma2ForCausalLM", head_dim=HD, sliding_window=SW),
        "gemma3": dec_llm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=HD, sliding_window=SW),
        "phi": dec_llm("PhiConfig", "PhiForCausalLM", num_key_value_heads=None),
        "phi3": dec_llm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
        "olmo": dec_llm("OlmoConfig", "OlmoForCausalLM", pad_token_id=0),
        "olmo2": dec_llm("Olmo2Config", "Olmo2ForCausalLM", pad_token_id=0),
        "stablelm": dec_llm("StableLmConfig", "StableLmForCausalLM"),
        "starcoder2": dec_llm("Starcoder2Config", "Starcoder2ForCausalLM"),
        "granite": dec_llm("GraniteConfig", "GraniteForCausalLM"),
        "cohere": dec_llm("CohereConfig", "CohereForCausalLM", pad_token_id=0),
        "persimmon": dec_llm("PersimmonConfig", "PersimmonForCausalLM", num_key_value_heads=None),
        # MoE: experts of 2 H (memory), eager experts (grouped_mm has no float64)
        "mixtral": dec_llm("MixtralConfig", "MixtralForCausalLM", intermediate_size=2 * H, num_local_experts=4,
                           num_experts_per_tok=2),
        "qwen2_moe": dec_llm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=H, shared_expert_intermediate_size=2 * H),
        "qwen3_moe": dec_llm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=H, head_dim=HD),
        "olmoe": dec_llm("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                         intermediate_size=H),
        "phimoe": dec_llm("PhimoeConfig", "PhimoeForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                          intermediate_size=H),
        "gpt2": lambda: (T.GPT2LMHeadModel(zero_dropout(T.GPT2Config(n_embd=H, n_layer=L, n_head=NH, vocab_size=V,
                                                                     n_positions=MP))), {"input_ids": ids()}),
        "gpt_bigcode": lambda: (T.GPTBigCodeForCausalLM(zero_dropout(T.GPTBigCodeConfig(
            n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=MP))), {"input_ids": ids()}),
        "gptj": lambda: (T.GPTJForCausalLM(zero_dropout(T.GPTJConfig(
            n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=MP, rotary_dim=max(8, HD // 2)))),
            {"input_ids": ids()}),
        "gpt_neo": lambda: (T.GPTNeoForCausalLM(zero_dropout(T.GPTNeoConfig(
            hidden_size=H, num_layers=L, num_heads=NH, vocab_size=V, max_position_embeddings=MP,
            attention_types=gpt_neo_types, window_size=SW))), {"input_ids": ids()}),
        "gpt_neox": lambda: (T.GPTNeoXForCausalLM(zero_dropout(T.GPTNeoXConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I, vocab_size=V,
            max_position_embeddings=MP))), {"input_ids": ids()}),
        "codegen": lambda: (T.CodeGenForCausalLM(zero_dropout(T.CodeGenConfig(
            n_embd=H, n_layer=L, n_head=NH, vocab_size=V, n_positions=MP, n_ctx=MP, rotary_dim=max(8, HD // 2)))),
            {"input_ids": ids()}),
        "opt": lambda: (T.OPTForCausalLM(zero_dropout(T.OPTConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, ffn_dim=I, vocab_size=V,
            max_position_embeddings=MP, word_embed_proj_dim=H))), {"input_ids": ids()}),
        "bloom": lambda: (T.BloomForCausalLM(zero_dropout(T.BloomConfig(hidden_size=H, n_layer=L, n_head=NH,
                                                                        vocab_size=V))), {"input_ids": ids()}),
        "falcon": lambda: (T.FalconForCausalLM(zero_dropout(T.FalconConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, vocab_size=V, max_position_embeddings=MP))),
            {"input_ids": ids()}),
        "falcon_newarch": lambda: (T.FalconForCausalLM(zero_dropout(T.FalconConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, vocab_size=V, new_decoder_architecture=True,
            num_kv_heads=KV, max_position_embeddings=MP))), {"input_ids": ids()}),
        "mpt": lambda: (T.MptForCausalLM(zero_dropout(T.MptConfig(d_model=H, n_layers=L, n_heads=NH, vocab_size=V,
                                                                  max_seq_len=MP))), {"input_ids": ids()}),
        "biogpt": enc_bert("BioGptConfig", "BioGptForCausalLM"),
        "xglm": lambda: (T.XGLMForCausalLM(zero_dropout(T.XGLMConfig(
            d_model=H, num_layers=L, attention_heads=NH, ffn_dim=I, vocab_size=V, max_position_embeddings=MP))),
            {"input_ids": ids()}),
        "mamba": lambda: (T.MambaForCausalLM(T.MambaConfig(hidden_size=H, num_hidden_layers=L, vocab_size=V,
                                                            state_size=8)), {"input_ids": ids()}),
        "nemotron": dec_llm("NemotronConfig", "NemotronForCausalLM", head_dim=HD),
        "glm": dec_llm("GlmConfig", "GlmForCausalLM", head_dim=HD, pad_token_id=0),
        "helium": dec_llm("HeliumConfig", "HeliumForCausalLM", head_dim=HD, pad_token_id=0),
        "smollm3": dec_llm("SmolLM3Config", "SmolLM3ForCausalLM", pad_token_id=0),
        "granitemoe": dec_llm("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4,
                              num_experts_per_tok=2, intermediate_size=H),
        "deepseek_v3": dec_llm("DeepseekV3Config", "DeepseekV3ForCausalLM", moe_intermediate_size=H,
                               n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                               first_k_dense_replace=1, q_lora_rank=H // 2, kv_lora_rank=H // 4,
                               qk_rope_head_dim=HD // 2, qk_nope_head_dim=HD // 2, v_head_dim=HD, head_dim=None),
        "gpt_oss": dec_llm("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                           head_dim=HD, sliding_window=SW, intermediate_size=H),
        "jamba": dec_llm("JambaConfig", "JambaForCausalLM", num_experts=2, num_experts_per_tok=1,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         mamba_d_state=8, use_mamba_kernels=False),
        "ctrl": lambda: (T.CTRLLMHeadModel(zero_dropout(T.CTRLConfig(n_embd=H, n_layer=L, n_head=NH, dff=I,
                         vocab_size=V, n_positions=MP))), {"input_ids": ids()}),
        "xlnet": lambda: (T.XLNetLMHeadModel(zero_dropout(T.XLNetConfig(d_model=H, n_layer=L, n_head=NH,
                          d_inner=I, vocab_size=V))), {"input_ids": ids()}),
        # encoders
        "roformer": enc_bert("RoFormerConfig", "RoFormerForMaskedLM"),
        "convbert": enc_bert("ConvBertConfig", "ConvBertForMaskedLM", embedding_size=H),
        "esm": enc_bert("EsmConfig", "EsmForMaskedLM", pad_token_id=1, mask_token_id=2),
        "ernie": enc_bert("ErnieConfig", "ErnieForMaskedLM"),
        "layoutlm": enc_bert("LayoutLMConfig", "LayoutLMForMaskedLM"),
        "big_bird": enc_bert("BigBirdConfig", "BigBirdForMaskedLM", attention_type="original_full"),
        "rembert": enc_bert("RemBertConfig", "RemBertForMaskedLM", input_embedding_size=H // 2,
                            output_embedding_size=H // 2),
        "bert": enc_bert("BertConfig", "BertForMaskedLM"),
        "roberta": enc_bert("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1),
        "xlm_roberta": enc_bert("XLMRobertaConfig", "XLMRobertaForMaskedLM", pad_token_id=1),
        "electra": enc_bert("ElectraConfig", "ElectraForMaskedLM", embedding_size=H // 2),
        "albert": enc_bert("AlbertConfig", "AlbertForMaskedLM", embedding_size=H // 2),
        "distilbert": lambda: (T.DistilBertForMaskedLM(zero_dropout(T.DistilBertConfig(
            dim=H, n_layers=L, n_heads=NH, hidden_dim=I, vocab_size=V, max_position_embeddings=MP))),
            {"input_ids": ids()}),
        "deberta": enc_bert("DebertaConfig", "DebertaForMaskedLM"),
        "deberta_v2": enc_bert("DebertaV2Config", "DebertaV2ForMaskedLM"),
        "mpnet": enc_bert("MPNetConfig", "MPNetForMaskedLM"),
        "mobilebert": enc_bert("MobileBertConfig", "MobileBertForMaskedLM", embedding_size=H // 2,
                               intra_bottleneck_size=H // 2, true_hidden_size=H // 2, num_feedforward_networks=2),
        "squeezebert": enc_bert("SqueezeBertConfig", "SqueezeBertForMaskedLM", embedding_size=H, q_groups=2,
                                k_groups=2, v_groups=2, post_attention_groups=2, intermediate_groups=2,
                                output_groups=2),
        "megatron_bert": enc_bert("MegatronBertConfig", "MegatronBertForMaskedLM"),
        "modernbert": enc_bert("ModernBertConfig", "ModernBertForMaskedLM", global_attn_every_n_layers=2,
                               local_attention=SW, pad_token_id=0),
        "funnel": lambda: (T.FunnelModel(zero_dropout(T.FunnelConfig(
            d_model=H, n_head=NH, d_head=HD, d_inner=I, block_sizes=[1, 1], vocab_size=V))), {"input_ids": ids()}),
        # encoder-decoder
        "t5": build_t5(),
        "t5_gated": build_t5(feed_forward_proj="gated-gelu"),
        "mt5": build_t5("MT5ForConditionalGeneration", "MT5Config"),
        "bart": seq2seq("BartConfig", "BartForConditionalGeneration"),
        "mbart": seq2seq("MBartConfig", "MBartForConditionalGeneration"),
        "pegasus": seq2seq("PegasusConfig", "PegasusForConditionalGeneration"),
        "marian": seq2seq("MarianConfig", "MarianMTModel", decoder_vocab_size=V),
        "blenderbot": seq2seq("BlenderbotConfig", "BlenderbotForConditionalGeneration"),
        "m2m100": seq2seq("M2M100Config", "M2M100ForConditionalGeneration"),
        "whisper": build_whisper,
        "umt5": build_t5("UMT5ForConditionalGeneration", "UMT5Config"),
        "longt5": build_t5("LongT5ForConditionalGeneration", "LongT5Config"),
        "switch_transformers": build_t5("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
                                        num_experts=4, expert_capacity=Bt * S, num_sparse_encoder_layers=1,
                                        num_sparse_decoder_layers=1),
        "plbart": seq2seq("PLBartConfig", "PLBartForConditionalGeneration"),
        "led": seq2seq("LEDConfig", "LEDForConditionalGeneration", max_encoder_position_embeddings=MP,
                       max_decoder_position_embeddings=MP, attention_window=[SW] * L, max_position_embeddings=None),
        # vision / audio / multimodal
        "vit": vision("ViTConfig", "ViTModel"),
        "deit": vision("DeiTConfig", "DeiTModel"),
        "beit": vision("BeitConfig", "BeitModel"),
        "dinov2": vision("Dinov2Config", "Dinov2Model"),
        "vit_mae": build_vit_mae,
        "clip": build_clip,
        "siglip": build_siglip,
        "swin": swin_like("SwinConfig", "SwinModel"),
        "convnext": build_convnext,
        "wav2vec2": build_wav2vec2(),
        "data2vec_audio": build_wav2vec2("Data2VecAudioConfig", "Data2VecAudioModel"),
        "sew": build_wav2vec2("SEWConfig", "SEWModel", squeeze_factor=1),
        "swinv2": swin_like("Swinv2Config", "Swinv2Model"),
        "yolos": vision("YolosConfig", "YolosModel", num_detection_tokens=4, size=[IMG, IMG]),
        "vit_msn": vision("ViTMSNConfig", "ViTMSNModel"),
        "ast": lambda: (T.ASTModel(zero_dropout(T.ASTConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=I, num_mel_bins=64,
            max_length=ast_t, patch_size=16, frequency_stride=16, time_stride=16))),
            {"input_values": floats(Bt, ast_t, 64)}),
        "imagegpt": lambda: (T.ImageGPTModel(zero_dropout(T.ImageGPTConfig(
            n_embd=H, n_layer=L, n_head=NH, vocab_size=V + 1, n_positions=MP))), {"input_ids": ids()}),
        "hubert": build_wav2vec2("HubertConfig", "HubertModel"),
    }


# ------------------------------------------------------------------------------------------------ helpers
def main_outputs(out):
    """The tensors compared / used for the loss: logits, else last_hidden_state, ...; CLIP-like: logits_per_image
    and both embeddings."""
    if isinstance(out, torch.Tensor):
        return {"out": out}
    res = {}
    for k in ("logits", "logits_per_image", "last_hidden_state", "text_embeds", "image_embeds", "pooler_output"):
        v = out.get(k) if hasattr(out, "get") else None
        if isinstance(v, torch.Tensor):
            res[k] = v
            if k in ("logits", "last_hidden_state"):
                break
    if not res:
        for k, v in out.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                res[k] = v
                break
    return res


def forward(model, inputs, grad):
    torch.manual_seed(1)
    with torch.set_grad_enabled(grad):
        return main_outputs(model(**inputs))


LOSS = ["proj"]  # --loss
DETAIL = [False]  # --detail
# Eager's gradient error above which the gradient checks loosen (the module docstring says why) by KINK_FACTOR.
KINK_ERROR = 1e-5
KINK_FACTOR = 4.0
# B's error may exceed A's by this factor: over a whole output or gradient, and per parameter (whose absolute error
# may also reach PARAMETER_FLOOR of the whole gradient's norm: a parameter with a tiny gradient holds rounding only).
ERROR_FACTOR = 1.25
PARAMETER_FACTOR = 2.0
PARAMETER_FLOOR = 1e-7


def loss_of(outs, f64=False):
    """square: sum over main outputs of out.float().square().mean() (float64 for A64). proj: mean of out times a
    fixed random tensor (seed 5, its float32 values for every model), for outputs a norm ends (a LayerNorm output's
    mean square is nearly constant, so the gradients before that norm are mostly rounding noise, which AdamW's first
    step turns into +-lr)."""
    total = 0
    for v in outs.values():
        v = v.double() if f64 else v.float()
        if LOSS[0] == "square":
            total = total + v.square().mean()
        else:
            g = torch.Generator().manual_seed(5)
            c = torch.randn(v.shape, generator=g).to(device=v.device, dtype=v.dtype)
            total = total + (v * c).mean()
    return total


def flat(outs):
    return torch.cat([v.detach().reshape(-1) for v in outs.values()])


def out_stats(ya, yb, y64):
    """Norm-wise errors of A and B against A64 over the whole (concatenated) main output, allclose(B, A), finite."""
    y64 = y64.double()
    nref = y64.norm().item()
    ea = (ya.double() - y64).norm().item() / nref
    eb = (yb.double() - y64).norm().item() / nref
    same_shape = ya.shape == yb.shape
    close = same_shape and torch.allclose(yb, ya, rtol=1e-4, atol=1e-4)
    maxd = (yb.double() - ya.double()).abs().max().item() if same_shape and ya.numel() else float("inf")
    finite = bool(torch.isfinite(ya).all() and torch.isfinite(yb).all())
    return {"A": ea, "B": eb, "allclose": bool(close), "max_abs_BA": maxd, "finite": finite}


def grad_stats(A, B, R):
    """Errors of A's and B's gradients against R's (float64), norm-wise over every parameter as one vector (a missing
    grad counts as zeros); finiteness; the parameters with a grad in A but not B or the other way round; under "_rows"
    each parameter's (name, |g64|, |gA - g64|, |gB - g64|) for worse_parameters. Parameters are paired by name."""
    named = [list(m.named_parameters()) for m in (A, B, R)]
    names = [[name for name, _ in params] for params in named]
    assert names[0] == names[1] == names[2], "A, B and A64 name their parameters differently"
    rows = []
    finite, none_diff = True, []
    for (name, pa), (_, pb), (_, pr) in zip(*named):
        ga, gb, gr = pa.grad, pb.grad, pr.grad
        if (ga is None) != (gb is None):
            none_diff.append(name)
        if ga is None and gb is None and gr is None:
            continue
        gr = gr.double() if gr is not None else torch.zeros(pr.shape, dtype=torch.float64, device=pr.device)
        errors = []
        for g in (ga, gb):
            if g is not None:
                finite = finite and bool(torch.isfinite(g).all())
            errors.append((gr if g is None else g.double() - gr).norm().item())
        rows.append((name, gr.norm().item(), *errors))
    nref = math.sqrt(sum(r[1] ** 2 for r in rows)) or 1.0
    if DETAIL[0]:
        for name, gnorm, ea, eb in sorted(rows, key=lambda r: r[2] - r[3])[:12]:
            print(f"    {name:60s} |g64| {gnorm:.3e} |gA-g64| {ea:.3e} |gB-g64| {eb:.3e}", flush=True)
    return {"A": math.sqrt(sum(r[2] ** 2 for r in rows)) / nref, "B": math.sqrt(sum(r[3] ** 2 for r in rows)) / nref,
            "finite": finite, "none_differ": none_diff[:8], "n_grads": len(rows), "_rows": rows}


def worse_parameters(stats, factor):
    """The parameters whose gradient's error in B exceeds `factor` times A's plus PARAMETER_FLOOR of the whole
    gradient's norm, worst first: (name, B's error, A's error), both relative to that norm."""
    rows = stats["_rows"]
    nref = math.sqrt(sum(r[1] ** 2 for r in rows)) or 1.0
    worse = [(name, eb / nref, ea / nref) for name, _, ea, eb in rows if eb > factor * ea + PARAMETER_FLOOR * nref]
    return sorted(worse, key=lambda w: -w[1])


def err_ok(s, factor=ERROR_FACTOR):
    return s["B"] <= factor * s["A"] + 1e-7


def linear_like(m):
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return isinstance(m, nn.Linear) or (conv1d is not None and isinstance(m, conv1d))


def split_counter(model, gemm_path, split_may_pay):
    """Pre-hooks on model's linear layers (model unpatched): per call, gemm_path's choice for its forward product and
    whether a backward product may split. Returns (stats dict, remove())."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    st = {"calls": 0, "fwd_split": 0, "bwd_may_split": 0, "paths": {}, "errors": 0}

    def hook(mod, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return
        w = mod.weight.t() if conv1d is not None and isinstance(mod, conv1d) else mod.weight
        st["calls"] += 1
        try:
            p = gemm_path(x.detach(), w.detach())
        except Exception:
            st["errors"] += 1
            return
        st["paths"][p] = st["paths"].get(p, 0) + 1
        n, k = w.shape
        m = x.numel() // k if k else 0
        st["fwd_split"] += p != "cublas"
        st["bwd_may_split"] += bool(x.is_cuda and x.dtype == torch.float32 and
                                    (split_may_pay(m, k, n) or split_may_pay(n, k, m)))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if linear_like(m)]
    return st, lambda: [h.remove() for h in handles]


def set_eager_experts(model):
    try:
        if type(model)._can_set_experts_implementation():
            model.set_experts_implementation("eager")
            return True
    except Exception:
        pass
    return False


def to_dev(inputs, device, dtype):
    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}


# ------------------------------------------------------------------------------------------------ one arch
def run_arch(name, builder, args, kernels, gemm_path, split_may_pay):
    dev = torch.device(args.device)
    rec = {"arch": name, "status": "ERROR", "checks": {}, "fails": [], "traceback": None}
    t0 = time.time()
    stage = "build"
    A = B = R = opa = opb = opr = None
    try:
        torch.manual_seed(0)
        model, inputs = builder()
        rec["eager_experts"] = set_eager_experts(model)
        A = model.float().to(dev).train()
        del model
        rec["n_params"] = sum(p.numel() for p in A.parameters())
        stage = "copy/patch"
        B = copy.deepcopy(A)
        kernels.patch(B)
        rec["patched"] = sum(1 for m in B.modules() if kernels.is_patched(m))
        R = copy.deepcopy(A).double()
        x32 = to_dev(inputs, dev, torch.float32)
        x64 = to_dev(inputs, dev, torch.float64)
        rec["input_shapes"] = {k: list(v.shape) for k, v in inputs.items()}

        def check(key, ok, why):
            rec["checks"][key] = bool(ok)
            if not ok:
                rec["fails"].append(f"{key}: {why}")

        def check_out(tag, s, factor=ERROR_FACTOR):
            check(f"{tag}:err", err_ok(s, factor), f"err B {s['B']:.3g} > {factor:g} * err A {s['A']:.3g} + 1e-7")
            if factor == ERROR_FACTOR:  # under a kink, B's output after the AdamW step is judged by its error alone
                check(f"{tag}:allclose", s["allclose"], f"max |B-A| {s['max_abs_BA']:.3g}")
            check(f"{tag}:finite", s["finite"], "non-finite output")

        def check_grads(tag, s, factor=ERROR_FACTOR):
            check(f"{tag}:err", err_ok(s, factor), f"err B {s['B']:.3g} > {factor:g} * err A {s['A']:.3g} + 1e-7")
            worse = worse_parameters(s, factor * PARAMETER_FACTOR / ERROR_FACTOR)
            s["worse_parameters"] = [f"{name} {eb:.3g} > {ea:.3g}" for name, eb, ea in worse[:8]]
            check(f"{tag}:parameters", not worse, f"{len(worse)} parameters' errors (B > A): {s['worse_parameters']}")
            check(f"{tag}:finite", s["finite"], "non-finite grad")
            check(f"{tag}:same_params", not s["none_differ"], f"grad None in one of A/B: {s['none_differ']}")
            del s["_rows"]

        check("patched", rec["patched"] > 0, "patch() changed no module")

        # 1. no_grad forward (split counts from A's identical calls)
        stage = "forward no_grad"
        st, remove = split_counter(A, gemm_path, split_may_pay)
        try:
            ya = flat(forward(A, x32, False))
        finally:
            remove()
        rec["split"] = st
        yb = flat(forward(B, x32, False))
        yr = flat(forward(R, x64, False))
        rec["fwd"] = out_stats(ya, yb, yr)
        check_out("fwd", rec["fwd"])
        del ya, yb, yr

        # 2./3. two training calls with an AdamW step between them
        opa = torch.optim.AdamW(A.parameters(), lr=1e-4)
        opb = torch.optim.AdamW(B.parameters(), lr=1e-4)
        opr = torch.optim.AdamW(R.parameters(), lr=1e-4)
        for step in (1, 2):
            stage = f"training call {step}"
            ys = []
            for m, x, f64 in ((A, x32, False), (B, x32, False), (R, x64, True)):  # one graph alive at a time
                m.zero_grad(set_to_none=True)
                o = forward(m, x, True)
                ys.append(flat(o) if step == 2 else None)
                loss_of(o, f64=f64).backward()
                del o
            if step == 2:
                rec["fwd2"] = out_stats(*ys)
                check_out("fwd2", rec["fwd2"], KINK_FACTOR if rec["kink"] else ERROR_FACTOR)
            del ys
            g = grad_stats(A, B, R)
            rec[f"grads{step}"] = g
            if step == 1:
                rec["kink"] = g["A"] > KINK_ERROR
            check_grads(f"grads{step}", g, KINK_FACTOR if rec["kink"] else ERROR_FACTOR)
            if step == 1:
                rec["groups"] = sum(1 for m in B.modules() if "_projection_group" in m.__dict__)
                stage = "optimizer step"
                opa.step(); opb.step(); opr.step()
        rec["status"] = "PASS" if not rec["fails"] else "FAIL"
    except Exception:
        rec["status"] = "ERROR"
        rec["stage"] = stage
        rec["traceback"] = traceback.format_exc()
    finally:
        rec["seconds"] = round(time.time() - t0, 2)
        if dev.type == "cuda":
            rec["max_mem_gb"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        # the loop's own references too (m is A64 after the loop; o and ys hold graphs where a call raised)
        A = B = R = opa = opb = opr = m = o = ys = None
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    return rec


def fmt(rec):
    def pair(k):
        s = rec.get(k)
        return f"{s['A']:.2e}/{s['B']:.2e}" if s else "-"
    sp = rec.get("split")
    split = f"split {sp['fwd_split']}/{sp['calls']} b{sp['bwd_may_split']}" if sp else "split -"
    line = (f"{rec['arch']:14s} {rec['status']:5s} fwd {pair('fwd')}  grad {pair('grads1')}  fwd2 {pair('fwd2')}  "
            f"grad2 {pair('grads2')}  {split} patched={rec.get('patched', '-')} groups={rec.get('groups', '-')} "
            f"{rec['seconds']:.1f}s")
    if rec.get("kink"):
        line += f" (gradients within {KINK_FACTOR:g}x eager's: its own error above {KINK_ERROR:g}, a kink's)"
    if "max_mem_gb" in rec:
        line += f" {rec['max_mem_gb']}GB"
    return line


class Timeout(BaseException):  # not caught by the checks' `except Exception`
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--only", default="", help="ARCH[,ARCH...]")
    ap.add_argument("--all", action="store_true", help="every builder, not the curated default set")
    ap.add_argument("--list", action="store_true", help="print the architectures and exit")
    ap.add_argument("--out", default=None, help="folder for architectures.jsonl (default $OUT, else /tmp)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per architecture (0: none)")
    ap.add_argument("--fuse", default="auto", choices=["auto", "always", "never"],
                    help="kernels.patching._fuse_projections (q/k/v grouping)")
    ap.add_argument("--loss", default="proj", choices=["square", "proj"],
                    help="proj: (out * fixed randn).mean() (default); square: out.square().mean()")
    ap.add_argument("--detail", action="store_true", help="each call's parameters with the largest gradient errors")
    args = ap.parse_args()
    LOSS[0] = args.loss
    DETAIL[0] = args.detail

    archs = make_archs(SimpleNamespace(hidden=args.hidden, heads=args.heads, layers=args.layers, vocab=args.vocab,
                                       seq=args.seq, batch=args.batch))
    if args.list:
        print("default:", " ".join(DEFAULT_SET))
        print("all:", " ".join(archs))
        return
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in archs]
        if unknown:
            sys.exit(f"unknown architectures: {unknown} (--list)")
    else:
        names = list(archs) if args.all else DEFAULT_SET
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device (use --device cpu)")

    # float32 means float32: no TF32 in eager's matmuls or convolutions (the library's paths need it off, too)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    t_imp = time.time()
    import kernels
    from kernels import patching
    from kernels.gemm.gemm import gemm_path, split_may_pay
    patching._fuse_projections = args.fuse
    if args.device == "cuda":  # load / build the op library and warm the device before timing archs
        x = torch.randn(64, 64, device="cuda")
        gemm_path(x, x)
        torch.cuda.synchronize()
    t_imp = time.time() - t_imp

    out_dir = args.out or os.environ.get("OUT") or "/tmp"
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "architectures.jsonl")
    open(out_path, "w").close()
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {dev_name} | torch {torch.__version__} | transformers {T.__version__} | hidden {args.hidden} "
          f"heads {args.heads} layers {args.layers} batch {args.batch} seq {args.seq} vocab {args.vocab} "
          f"loss {args.loss} fuse {args.fuse} | "
          f"{len(names)} archs | kernels import+load {t_imp:.1f}s | out {out_path}", flush=True)
    print("errors are ||y - y64|| / ||y64||, A (eager) / B (patched); split f/n: calls whose forward takes a split "
          "path / linear calls, b: calls where a backward product may split", flush=True)

    def on_alarm(*_):
        raise Timeout()
    if args.timeout:
        signal.signal(signal.SIGALRM, on_alarm)
    t_all = time.time()
    rows = []
    for n in names:
        if args.timeout:
            signal.alarm(args.timeout)
        try:
            rec = run_arch(n, archs[n], args, kernels, gemm_path, split_may_pay)
        except Timeout:
            rec = {"arch": n, "status": "ERROR", "stage": "timeout", "traceback": f"timeout {args.timeout}s",
                   "seconds": args.timeout, "fails": []}
            if args.device == "cuda":
                torch.cuda.empty_cache()
        finally:
            signal.alarm(0)
        rows.append(rec)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(fmt(rec), flush=True)
        for fl in rec.get("fails", [])[:6]:
            print("    fail:", fl, flush=True)
        if rec.get("traceback"):
            print(f"    error[{rec.get('stage')}]:", rec["traceback"].strip().splitlines()[-1][:300], flush=True)

    total = time.time() - t_all
    by = {}
    for r in rows:
        by.setdefault(r["status"], []).append(r["arch"])
    print(f"\nsummary: {len(rows)} archs in {total:.1f}s (+ {t_imp:.1f}s kernels import/load): "
          + ", ".join(f"{k} {len(v)}" for k, v in sorted(by.items())), flush=True)
    for k in ("FAIL", "ERROR"):
        if by.get(k):
            print(f"  {k}: {' '.join(by[k])}", flush=True)
    no_split = [r["arch"] for r in rows if r.get("split") and not r["split"]["fwd_split"]]
    if args.device == "cuda" and no_split:
        print(f"  no split-path forward call: {' '.join(no_split)}", flush=True)
    print(f"results: {out_path}", flush=True)
    sys.exit(0 if not by.get("FAIL") and not by.get("ERROR") else 1)


if __name__ == "__main__":
    main()
