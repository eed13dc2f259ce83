"""SAM 3 at full size with random weights, as the side-by-side benchmark runs it (tools/bench/compare.py, row
`sam3`): transformers' `Sam3Model` modules driven along the original package's grounding path (the ViT's
LayerNorms at eps 1e-5 and the empty geometry prompt's token joining every prompt, as edgerun runs by default;
tests/fixtures/sam3_tiny_original checks that this equals the `sam3` package), the backbone once for the
image and the prompts batched through the text encoder, the DETR encoder and decoder, the scoring and the
mask decoder — the work edgerun does.

    build(workdir) -> (forward, inputs, outputs)   saves config.json + model.safetensors under workdir
"""
import torch

TEXTS = ["building", "roof", "house", "tree", "forest", "water", "river", "road"]
PROMPTS = len(TEXTS)
CONTEXT = 32
OUTPUTS = ["pred_masks", "pred_boxes", "pred_logits", "presence_logits", "semantic_seg"]


def clip_tokenizer(workdir):
    """transformers' CLIPTokenizer on CLIP's own BPE (as tools/fixtures/clip_tokenizer.py builds it), saved as
    `tokenizer.json` beside the model so that edgerun tokenizes the same prompts."""
    import importlib.util
    import os
    import sys

    # The fixture script imports tools/fixtures/common.py as `common`, which tools/bench/common.py shadows.
    bench_common = sys.modules.pop("common", None)
    try:
        spec = importlib.util.spec_from_file_location("clip_fixture", os.path.join(os.path.dirname(__file__), "..", "fixtures", "clip_tokenizer.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop("common", None)
        if bench_common is not None:
            sys.modules["common"] = bench_common
    tok = mod.tokenizer(*mod.full_bpe())
    tok.backend_tokenizer.save(os.path.join(workdir, "tokenizer.json"))
    return tok


def prompt_ids(tok):
    """Token ids and masks of TEXTS as SAM 3's processor makes them."""
    enc = tok(TEXTS, padding="max_length", max_length=CONTEXT, truncation=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def original_path(model):
    """The original package's numbers on transformers' modules: the ViT's LayerNorms at eps 1e-5."""
    for m in model.vision_encoder.backbone.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 1e-5
    return model


@torch.no_grad()
def ground(model, pixel_values, input_ids, attention_mask):
    """The grounding outputs of every prompt on one image, prompts batched."""
    from transformers.models.sam3.modeling_sam3 import box_cxcywh_to_xyxy, inverse_sigmoid

    p = input_ids.shape[0]
    v = model.get_vision_features(pixel_values=pixel_values)
    fpn, pos = v.fpn_hidden_states[:-1], v.fpn_position_encoding[:-1]
    text = model.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
    geo = model.geometry_encoder(box_embeddings=torch.zeros(1, 0, 4), box_mask=torch.zeros(1, 0, dtype=torch.bool),
                                 box_labels=torch.zeros(1, 0, dtype=torch.long), img_feats=fpn, img_pos_embeds=pos)
    prompt = torch.cat([text, geo.last_hidden_state.expand(p, -1, -1)], 1)
    mask = torch.cat([attention_mask.bool(), torch.ones(p, 1, dtype=torch.bool)], 1)
    levels = [f.expand(p, -1, -1, -1) for f in fpn]
    enc = model.detr_encoder(vision_features=[levels[-1]], text_features=prompt, vision_pos_embeds=[pos[-1].expand(p, -1, -1, -1)],
                             text_mask=mask)
    dec = model.detr_decoder(vision_features=enc.last_hidden_state, text_features=enc.text_features,
                             vision_pos_encoding=enc.pos_embeds_flattened, text_mask=mask, spatial_shapes=enc.spatial_shapes)
    last = dec.intermediate_hidden_states[-1:]
    logits = model.dot_product_scoring(decoder_hidden_states=last, text_features=enc.text_features, text_mask=mask).squeeze(-1)[-1]
    boxes = box_cxcywh_to_xyxy((inverse_sigmoid(dec.reference_boxes[-1]) + model.detr_decoder.box_head(last[-1])).sigmoid())
    md = model.mask_decoder(decoder_queries=last[-1], backbone_features=levels, encoder_hidden_states=enc.last_hidden_state,
                            prompt_features=prompt, prompt_mask=mask)
    return {"pred_masks": md.pred_masks, "pred_boxes": boxes, "pred_logits": logits,
            "presence_logits": dec.presence_logits[-1], "semantic_seg": md.semantic_seg}


def build(workdir, reinit):
    """The full-size model (random O(1) weights via `reinit`) saved under `workdir`, its forward and inputs."""
    import os

    from transformers import Sam3Config, Sam3Model

    model = Sam3Model(Sam3Config()).eval()
    reinit(model, 0)
    model.save_pretrained(workdir)
    original_path(model)
    ids, mask = prompt_ids(clip_tokenizer(workdir))
    with open(os.path.join(workdir, "prompts.txt"), "w") as f:
        f.write("\n".join(TEXTS) + "\n")
    x = torch.randn(1, 3, 1008, 1008, generator=torch.Generator().manual_seed(1))
    inputs = {"pixel_values": x, "input_ids": ids, "attention_mask": mask}
    return (lambda **kw: ground(model, **kw)), inputs, OUTPUTS
