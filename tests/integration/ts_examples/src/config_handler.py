"""Reads its archive's model-config.yaml the way TorchServe handlers do (context.model_yaml_config)."""

from ts.torch_handler.base_handler import BaseHandler


class ConfigHandler(BaseHandler):
    def initialize(self, context):
        self.manifest = context.manifest
        self.model_yaml_config = context.model_yaml_config
        self.initialized = True

    def handle(self, data, context):
        props = context.system_properties
        answer = {
            "yaml": self.model_yaml_config,
            "batch_size": props.get("batch_size"),
            "rows": len(data),
        }
        return [answer for _ in data]
